//! Picking the next token from a row of logits: greedy (the first largest), or a draw from the
//! softmax after `transformers`' warpers in their order (temperature, top-k, top-p), from a
//! seeded ChaCha generator (the same seed, the same tokens).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How tokens are picked: the settings of a [`GenerationConfig`](super::GenerationConfig) and
/// the generator they draw from.
#[derive(Debug, Clone)]
pub(crate) struct Sampler {
    /// `None`: greedy.
    temperature: Option<f64>,
    top_k: Option<usize>,
    top_p: Option<f64>,
    rng: ChaCha8Rng,
}

impl Sampler {
    /// Greedy when `temperature` is `None` (or 0); else draws seeded by `seed`.
    pub(crate) fn new(
        temperature: Option<f64>,
        top_k: Option<usize>,
        top_p: Option<f64>,
        seed: u64,
    ) -> Self {
        Sampler {
            temperature: temperature.filter(|&t| t > 0.0),
            top_k,
            top_p,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// The next token of a sequence whose last logits are `logits`.
    pub(crate) fn pick(&mut self, logits: &[f32]) -> u32 {
        let Some(t) = self.temperature else {
            return argmax(logits);
        };
        let mut scores: Vec<f64> = logits.iter().map(|&x| f64::from(x) / t).collect();
        if let Some(k) = self.top_k {
            top_k(&mut scores, k);
        }
        if let Some(p) = self.top_p {
            top_p(&mut scores, p);
        }
        let probs = softmax(&scores);
        let u: f64 = self.rng.random();
        let mut acc = 0.0;
        let mut last = argmax(logits);
        for (i, &p) in probs.iter().enumerate() {
            if p > 0.0 {
                last = i as u32;
                acc += p;
                if u < acc {
                    return i as u32;
                }
            }
        }
        // Rounding left `u` above the sum: the last token that had any probability.
        last
    }
}

/// What makes a row of logits unusable, as the end of a sentence (`hold NaN at id 3 of 64`), or
/// `None` when a token can be picked from it: no NaN, no +inf and at least one value above -inf
/// (-inf alone is a token ruled out). Weights are finite (loading checks them), but activations
/// can overflow on the way. Greedy picking would take a NaN row's last id and a draw the argmax
/// of its logits: garbage either way, with nothing to tell.
pub(crate) fn unusable(logits: &[f32]) -> Option<String> {
    let vocab = logits.len();
    if vocab == 0 {
        return Some("are empty (no vocabulary)".into());
    }
    if let Some(id) = logits.iter().position(|x| x.is_nan()) {
        return Some(format!("hold NaN at id {id} of {vocab}"));
    }
    if let Some(id) = logits.iter().position(|&x| x == f32::INFINITY) {
        return Some(format!("hold +inf at id {id} of {vocab}"));
    }
    if logits.iter().all(|&x| x == f32::NEG_INFINITY) {
        return Some(format!("are -inf at all {vocab} ids"));
    }
    None
}

/// The index of the first largest value (NaN never wins).
pub(crate) fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] || xs[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Keeps the `k` largest scores (and any tied with the k-th), the others set to -inf.
fn top_k(scores: &mut [f64], k: usize) {
    if k == 0 || k >= scores.len() {
        return;
    }
    let mut sorted = scores.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let kth = sorted[k - 1];
    for s in scores.iter_mut() {
        if *s < kth {
            *s = f64::NEG_INFINITY;
        }
    }
}

/// Keeps the fewest largest scores whose probabilities sum to at least `p` (at least one), the
/// others set to -inf.
fn top_p(scores: &mut [f64], p: f64) {
    if p >= 1.0 {
        return;
    }
    let probs = softmax(scores);
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let mut acc = 0.0;
    let mut keep = vec![false; scores.len()];
    for &i in &order {
        keep[i] = true;
        acc += probs[i];
        if acc >= p {
            break;
        }
    }
    for (s, keep) in scores.iter_mut().zip(keep) {
        if !keep {
            *s = f64::NEG_INFINITY;
        }
    }
}

/// The softmax of `scores` (-inf gives 0).
fn softmax(scores: &[f64]) -> Vec<f64> {
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exp: Vec<f64> = scores.iter().map(|&s| (s - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    exp.iter().map(|e| e / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_and_top_p_keep_the_largest() {
        let mut s = vec![1.0, 3.0, 2.0, 3.0, 0.0];
        top_k(&mut s, 2);
        assert_eq!(s.iter().filter(|x| x.is_finite()).count(), 2);
        assert!(s[1].is_finite() && s[3].is_finite());
        // probabilities about 0.64, 0.24, 0.09, 0.03: 0.7 needs the first two.
        let mut s = vec![3.0, 2.0, 1.0, 0.0];
        top_p(&mut s, 0.7);
        assert_eq!(s.iter().filter(|x| x.is_finite()).count(), 2);
        let mut s = vec![3.0, 2.0, 1.0, 0.0];
        top_p(&mut s, 0.5);
        assert_eq!(s.iter().filter(|x| x.is_finite()).count(), 1);
    }

    #[test]
    fn rows_without_a_pickable_token_are_named() {
        let nan = [0.0, f32::NAN, 1.0];
        assert_eq!(unusable(&nan).as_deref(), Some("hold NaN at id 1 of 3"));
        let inf = [f32::NEG_INFINITY, 2.0, f32::INFINITY];
        assert_eq!(unusable(&inf).as_deref(), Some("hold +inf at id 2 of 3"));
        let none = [f32::NEG_INFINITY; 4];
        assert_eq!(unusable(&none).as_deref(), Some("are -inf at all 4 ids"));
        assert_eq!(unusable(&[]).as_deref(), Some("are empty (no vocabulary)"));
        // Ruled-out tokens and large finite values are fine.
        assert_eq!(unusable(&[f32::NEG_INFINITY, f32::MAX, -f32::MAX]), None);
    }

    #[test]
    fn draws_follow_the_seed_and_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let mut a = Sampler::new(Some(1.0), None, None, 7);
        let mut counts = [0usize; 3];
        for _ in 0..4000 {
            counts[a.pick(&logits) as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        let share = counts[1] as f64 / 4000.0;
        assert!((share - 0.75).abs() < 0.03, "share of token 1: {share}");
        let draws = |seed| {
            let mut s = Sampler::new(Some(1.0), None, None, seed);
            (0..32).map(|_| s.pick(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draws(3), draws(3));
        assert_ne!(draws(3), draws(4));
        assert_eq!(Sampler::new(None, None, None, 0).pick(&[1.0, 5.0, 5.0]), 1);
    }
}
