//! Which GPU each rank drives, and whether ranks share one.
//!
//! NCCL refuses two ranks on one GPU. When ranks share a GPU (`accelerate-rs launch -n 2` on a
//! one-GPU machine, a laptop, DP replicas asked for beyond the GPUs present), GPU tensors are
//! reduced through the host instead, over the same shared-memory/TCP transport (or thread group)
//! the CPU path uses, with one warning. The decisions are plain functions of the ranks' GPU
//! identities, so they are tested without a GPU.
//!
//! **What "the same GPU" means** is NCCL's own rule: the same PCI bus id on the same host (NCCL
//! refuses a communicator whose ranks repeat a `(host, bus id)` pair). Two MIG slices of one GPU
//! have different UUIDs but one bus id, so they count as one GPU; two hosts can have a GPU at the
//! same bus id, so the host is part of the key ([`gpu_key`], [`host_identity`]).
//!
//! The host is NCCL's too: `NCCL_HOSTID` when set. Two processes on one GPU with different
//! `NCCL_HOSTID`s are two hosts to NCCL and to this placement, which then picks NCCL
//! (`scripts/gpu-two-hosts.sh` runs real NCCL at world size 2 on a one-GPU machine that way, over
//! NCCL's socket transport). DP replicas are threads of one process, which has one
//! `NCCL_HOSTID`: two of them on one GPU always share it, and take the host path.

use crate::collective::{Buffer, Collective};
use crate::error::{Error, Result};
#[cfg(test)]
use crate::settings::place::gpu_ordinal;

/// The placement key of a GPU: the host (see [`host_identity`]) and the GPU's PCI bus id. Two
/// ranks drive the same GPU, as NCCL sees it, exactly when their keys are equal.
pub(crate) fn gpu_key(host: &str, pci_bus_id: &str) -> Vec<u8> {
    format!("{host}/{}", pci_bus_id.to_ascii_lowercase()).into_bytes()
}

/// This host as NCCL tells hosts apart: `NCCL_HOSTID` when set, else the host name up to its
/// first dot and the boot id (`/proc/sys/kernel/random/boot_id`), so that containers with one
/// host name on different machines stay apart.
pub(crate) fn host_identity() -> String {
    let hostid = crate::settings::runtime::nccl_host_id();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok();
    host_identity_from(hostid.as_deref(), &host_name(), boot.as_deref())
}

/// [`host_identity`] from its parts.
pub(crate) fn host_identity_from(
    hostid: Option<&str>,
    hostname: &str,
    boot_id: Option<&str>,
) -> String {
    if let Some(id) = hostid.map(str::trim).filter(|s| !s.is_empty()) {
        return id.to_string();
    }
    let short = hostname.split('.').next().unwrap_or(hostname);
    match boot_id.map(str::trim).filter(|s| !s.is_empty()) {
        Some(boot) => format!("{short}:{boot}"),
        None => short.to_string(),
    }
}

/// The host name (`gethostname`), or `localhost` if it cannot be read.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for `buf.len()` bytes; gethostname writes at most that many and
    // the result is read only up to the first NUL (or the whole buffer).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The first two ranks (in rank order) whose GPU identities are equal, if any.
pub(crate) fn first_shared<T: PartialEq>(ids: &[T]) -> Option<(usize, usize)> {
    ids.iter()
        .enumerate()
        .find_map(|(b, id)| ids[..b].iter().position(|x| x == id).map(|a| (a, b)))
}

/// Exchanges this rank's GPU identity `id` with every rank over `host` and returns the first two
/// ranks that drive the same GPU, if any. Every rank gets the same answer.
pub(crate) fn shared_gpu(host: &dyn Collective, id: &[u8]) -> Result<Option<(usize, usize)>> {
    let all = host.all_gather(Buffer::from(id))?;
    let ids: Vec<&[u8]> = all.iter().map(|b| b.bytes()).collect();
    if let Some((r, bad)) = ids.iter().enumerate().find(|(_, b)| b.is_empty()) {
        return Err(Error::Mismatch {
            rank: host.rank(),
            op: "GPU placement".into(),
            detail: format!(
                "rank {r} reported no GPU identity ({} bytes); every rank must drive a GPU",
                bad.len()
            ),
        });
    }
    Ok(first_shared(&ids))
}

/// The warning printed once (by the main process) when ranks share a GPU.
pub(crate) fn sharing_warning(a: usize, b: usize, what: &str, via: &str) -> String {
    format!(
        "accelerate-rs: warning: {what} {a} and {b} drive the same GPU; NCCL cannot put two ranks on one GPU, so GPU tensors are reduced through the host over {via} (slower than NCCL). Give each rank its own GPU (at most one process or DP replica per GPU) to use NCCL."
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::ThreadGroup;
    use std::time::Duration;

    #[test]
    fn ordinal_is_the_local_rank_when_there_are_enough_gpus() {
        assert_eq!(gpu_ordinal(0, 8), Some(0));
        assert_eq!(gpu_ordinal(7, 8), Some(7));
        assert_eq!(gpu_ordinal(3, 4), Some(3));
    }

    #[test]
    fn one_visible_gpu_is_gpu_0_whatever_the_local_rank() {
        // SLURM --gpus-per-task=1: each task sees one GPU but has LOCAL_RANK 0..n.
        for local in 0..5 {
            assert_eq!(gpu_ordinal(local, 1), Some(0));
        }
    }

    #[test]
    fn more_ranks_than_gpus_wrap_around_and_none_without_gpus() {
        assert_eq!(gpu_ordinal(2, 2), Some(0));
        assert_eq!(gpu_ordinal(5, 2), Some(1));
        assert_eq!(gpu_ordinal(0, 0), None);
        assert_eq!(gpu_ordinal(3, 0), None);
    }

    #[test]
    fn first_shared_finds_the_first_pair_in_rank_order() {
        assert_eq!(first_shared::<u8>(&[]), None);
        assert_eq!(first_shared(&[1]), None);
        assert_eq!(first_shared(&[1, 2, 3]), None);
        assert_eq!(first_shared(&[1, 1]), Some((0, 1)));
        assert_eq!(first_shared(&[1, 2, 3, 2, 1]), Some((1, 3)));
        assert_eq!(first_shared(&[4, 5, 6, 4]), Some((0, 3)));
    }

    /// Every rank exchanges a (fake) GPU identity over a real thread group and all agree.
    fn exchange(ids: &[&'static [u8]]) -> Vec<Result<Option<(usize, usize)>>> {
        let group = ThreadGroup::new(ids.len(), Duration::from_secs(10)).unwrap();
        let handles: Vec<_> = group
            .into_iter()
            .zip(ids.iter().copied())
            .map(|(c, id)| std::thread::spawn(move || shared_gpu(&c, id)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn ranks_agree_on_sharing_for_1_to_5_ranks() {
        let uuids: [&[u8]; 5] = [b"GPU-a", b"GPU-b", b"GPU-c", b"GPU-d", b"GPU-e"];
        for n in 1..=5 {
            for r in exchange(&uuids[..n]) {
                assert_eq!(r.unwrap(), None, "{n} distinct GPUs");
            }
        }
        // Two processes on a one-GPU machine.
        for r in exchange(&[b"GPU-a", b"GPU-a"]) {
            assert_eq!(r.unwrap(), Some((0, 1)));
        }
        // 3 ranks on 2 GPUs (local ranks wrapped around).
        for r in exchange(&[b"GPU-a", b"GPU-b", b"GPU-a"]) {
            assert_eq!(r.unwrap(), Some((0, 2)));
        }
    }

    #[test]
    fn two_mig_slices_of_one_gpu_are_one_gpu_and_hosts_stay_apart() {
        let host_a = host_identity_from(None, "node-a.cluster", Some("boot-1\n"));
        let host_b = host_identity_from(None, "node-b", Some("boot-2"));
        assert_eq!(host_a, "node-a:boot-1");
        // Two MIG slices (different UUIDs) of the GPU at bus 0000:17:00 on one host: NCCL
        // would refuse them as duplicates, so they share.
        let a: &'static [u8] = Box::leak(gpu_key(&host_a, "0000:17:00").into_boxed_slice());
        let b: &'static [u8] = Box::leak(gpu_key(&host_a, "0000:17:00").into_boxed_slice());
        for r in exchange(&[a, b]) {
            assert_eq!(r.unwrap(), Some((0, 1)));
        }
        // The same bus id on two hosts: two GPUs. Letter case does not matter.
        let c: &'static [u8] = Box::leak(gpu_key(&host_b, "0000:17:00").into_boxed_slice());
        let d: &'static [u8] = Box::leak(gpu_key(&host_a, "0000:31:00").into_boxed_slice());
        for r in exchange(&[a, c, d]) {
            assert_eq!(r.unwrap(), None);
        }
        assert_eq!(gpu_key("h", "0000:AB:00"), gpu_key("h", "0000:ab:00"));
        // NCCL_HOSTID wins; without a boot id the short host name is the host.
        assert_eq!(host_identity_from(Some(" rack7 "), "x", Some("b")), "rack7");
        assert_eq!(host_identity_from(Some(""), "x.y", None), "x");
        assert!(!host_identity().is_empty());
    }

    #[test]
    fn two_ranks_on_one_gpu_with_their_own_nccl_hostid_are_two_hosts_and_take_nccl() {
        // scripts/gpu-smoke.sh's two-rank NCCL proof on a one-GPU machine: one host name, one
        // boot id, one GPU, but NCCL_HOSTID differs per rank. NCCL then sees two hosts (it
        // keys hosts by NCCL_HOSTID too), so placement must not fall back to the host path:
        // no shared GPU, hence `connect` picks NCCL.
        let key = |hostid: Option<&str>| -> &'static [u8] {
            let host = host_identity_from(hostid, "gpu-box.cluster", Some("boot-1"));
            Box::leak(gpu_key(&host, "0000:17:00").into_boxed_slice())
        };
        for r in exchange(&[key(Some("accel-smoke-0")), key(Some("accel-smoke-1"))]) {
            assert_eq!(r.unwrap(), None);
        }
        // Without it (or with the same one on both), one GPU: the host path.
        for r in exchange(&[key(None), key(None)]) {
            assert_eq!(r.unwrap(), Some((0, 1)));
        }
        for r in exchange(&[key(Some("same")), key(Some("same"))]) {
            assert_eq!(r.unwrap(), Some((0, 1)));
        }
    }

    #[test]
    fn a_rank_without_an_identity_is_an_error_naming_it() {
        for r in exchange(&[b"GPU-a", b""]) {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("rank 1 reported no GPU identity"), "{e}");
        }
    }

    #[test]
    fn the_warning_names_the_ranks_and_the_way_out() {
        let w = sharing_warning(0, 1, "ranks", "shm");
        assert!(w.contains("ranks 0 and 1"), "{w}");
        assert!(w.contains("over shm"), "{w}");
        assert!(w.contains("its own GPU"), "{w}");
    }
}
