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
    // The common case, every logit finite, in one pass; the rest only to say what is wrong.
    if vocab > 0 && logits.iter().all(|x| x.is_finite()) {
        return None;
    }
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

/// Keeps the `k` largest scores (and any tied with the k-th), the others set to -inf. The k-th
/// is found by selection, in time linear in the vocabulary (a sort of 150,000 scores took 7 ms a
/// token).
fn top_k(scores: &mut [f64], k: usize) {
    if k == 0 || k >= scores.len() {
        return;
    }
    let mut largest = scores.to_vec();
    let (_, &mut kth, _) = largest.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    for s in scores.iter_mut() {
        if *s < kth {
            *s = f64::NEG_INFINITY;
        }
    }
}

/// How many of the most likely tokens [`top_p`] sorts first; 16 times more each time they do not
/// reach `p`.
const TOP_P_HEAD: usize = 1024;

/// Keeps the fewest largest scores whose probabilities sum to at least `p` (at least one), the
/// others set to -inf. Tokens are taken by decreasing probability, ties by increasing id.
fn top_p(scores: &mut [f64], p: f64) {
    if p >= 1.0 {
        return;
    }
    let probs = softmax(scores);
    let mut keep = vec![false; scores.len()];
    for i in nucleus(&probs, p) {
        keep[i] = true;
    }
    for (s, keep) in scores.iter_mut().zip(keep) {
        if !keep {
            *s = f64::NEG_INFINITY;
        }
    }
}

/// The ids [`top_p`] keeps, from the probabilities: the same tokens as a sort of the whole
/// vocabulary (7-13 ms a token at 150,000), summed in the same order, found in less time. The
/// mass of a language model's next token mostly sits in its first few hundred tokens: those are
/// found by selection (linear time) and sorted, then the next 16 times as many from the rest,
/// and so on until the sum reaches `p`.
fn nucleus(probs: &[f64], p: f64) -> Vec<usize> {
    let before = |&a: &usize, &b: &usize| probs[b].total_cmp(&probs[a]).then(a.cmp(&b));
    let mut order: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] > 0.0).collect();
    let likely = order.len();
    let mut acc = 0.0;
    let mut done = 0;
    let mut size = TOP_P_HEAD;
    while done < likely {
        let rest = &mut order[done..likely];
        let take = size.min(rest.len());
        if take < rest.len() {
            rest.select_nth_unstable_by(take - 1, before);
        }
        rest[..take].sort_unstable_by(before);
        for n in done..done + take {
            acc += probs[order[n]];
            if acc >= p {
                order.truncate(n + 1);
                return order;
            }
        }
        done += take;
        size = size.saturating_mul(16);
    }
    // Rounding left every likely token's sum below `p`: tokens of probability 0 add nothing,
    // and every token is kept.
    (0..probs.len()).collect()
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

    /// `top_k` and `top_p` as first written: a sort of the whole vocabulary.
    fn top_k_by_sorting(scores: &mut [f64], k: usize) {
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

    fn top_p_by_sorting(scores: &mut [f64], p: f64) {
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

    /// Selection keeps exactly the tokens the full sort kept: peaked and flat rows, ties, -inf,
    /// vocabularies below and far above the sorted head, with and without top-k first.
    #[test]
    fn selection_keeps_what_sorting_kept() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for case in 0..300 {
            let v = [3, 40, 1000, 1025, 5000, 20000][case % 6];
            let spread = [0.1, 2.0, 10.0, 40.0][case % 4];
            let mut logits: Vec<f64> = (0..v)
                .map(|_| (rng.random::<f64>() - 0.5) * spread)
                .collect();
            // Ties (rounded scores) and ruled-out tokens.
            if case % 3 == 0 {
                logits.iter_mut().for_each(|x| *x = x.round());
            }
            if case % 5 == 0 {
                logits[case % v] = f64::NEG_INFINITY;
            }
            let k = [1, 5, 50, 2000][case % 4];
            let p = [0.1, 0.5, 0.9, 0.999, 1.0][case % 5];
            let (mut a, mut b) = (logits.clone(), logits.clone());
            if case % 2 == 0 {
                top_k(&mut a, k);
                top_k_by_sorting(&mut b, k);
                assert_eq!(a, b, "case {case}: top_k {k} of {v}");
            }
            top_p(&mut a, p);
            top_p_by_sorting(&mut b, p);
            assert_eq!(a, b, "case {case}: top_p {p} of {v}");
        }
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
