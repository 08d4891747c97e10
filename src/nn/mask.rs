//! Attention masks shared by the composed attention and the causal softmax.

use std::sync::Mutex;

use candle_core::{Result, Tensor};

/// How many causal masks [`causal_mask`] keeps (devices × sizes; a training run uses one or two).
const CAUSAL_MASKS_KEPT: usize = 16;

/// Causal masks already built, per device and size.
static CAUSAL_MASKS: Mutex<Vec<(candle_core::Device, usize, usize, Tensor)>> =
    Mutex::new(Vec::new());

/// The causal mask `[T_q, T_k]` (u8, 1 where query `i` sees key `j`: `j <= i + T_k - T_q`) on
/// `dev`, built there once (two `arange`s and a comparison) and then reused from a small cache:
/// the composed attention of every layer and step shares it.
pub(super) fn causal_mask(tq: usize, tk: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let mut cache = CAUSAL_MASKS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((.., m)) = cache
        .iter()
        .find(|(d, q, k, _)| (*q, *k) == (tq, tk) && d.same_device(dev))
    {
        return Ok(m.clone());
    }
    if tq > tk || u32::try_from(tk).is_err() {
        candle_core::bail!("causal mask: {tq} queries and {tk} keys (T_q <= T_k < 2^32 needed)");
    }
    // Row i's last visible key, i + T_k - T_q, as a column; the key indices as a row.
    let last = Tensor::arange((tk - tq) as u32, tk as u32, dev)?.reshape((tq, 1))?;
    let keys = Tensor::arange(0u32, tk as u32, dev)?.reshape((1, tk))?;
    let mask = keys.broadcast_le(&last)?.contiguous()?;
    if cache.len() >= CAUSAL_MASKS_KEPT {
        cache.remove(0);
    }
    cache.push((dev.clone(), tq, tk, mask.clone()));
    Ok(mask)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{CpuStorage, Device, Storage};

    #[test]
    fn the_causal_mask_is_built_once_per_device_and_size() {
        let dev = Device::Cpu;
        let a = causal_mask(3, 5, &dev).unwrap();
        assert_eq!(
            a.to_vec2::<u8>().unwrap(),
            [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
        );
        let b = causal_mask(3, 5, &dev).unwrap();
        // The same storage: the cached tensor, not a new one.
        let addr = |t: &Tensor| match &*t.storage_and_layout().0 {
            Storage::Cpu(CpuStorage::U8(v)) => v.as_ptr() as usize,
            _ => 0,
        };
        assert_eq!(addr(&a), addr(&b));
        assert_ne!(addr(&a), addr(&causal_mask(4, 5, &dev).unwrap()));
        assert!(causal_mask(6, 5, &dev).is_err());
    }
}
