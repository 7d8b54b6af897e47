//! Choosing the next token from logits: greedy, or temperature with top-k and top-p (nucleus)
//! filtering, from a seeded generator so a run can be repeated exactly.

use tinygpt_kernels::ops::sample::{MAX_TOP_K, RowSampling};

/// How to pick tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerConfig {
    /// 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches p (1: all).
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 200,
            top_p: 1.0,
            seed: 1337,
        }
    }
}

impl SamplerConfig {
    /// Checks the settings; the message says what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature {} must be a finite number >= 0",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p {} must be in (0, 1]", self.top_p));
        }
        Ok(())
    }
}

/// A seeded sampler.
pub struct Sampler {
    cfg: SamplerConfig,
    state: u64,
    /// Tokens drawn on a device so far (the counter of the device sampler's stream).
    device_draws: u32,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        Sampler {
            state: cfg.seed ^ 0x2545_F491_4F6C_DD1D,
            cfg,
            device_draws: 0,
        }
    }

    /// The settings of the next token for the device sampler
    /// ([`tinygpt_kernels::ops::sample`]), when it takes them (greedy, or a top-k of 1 to
    /// [`MAX_TOP_K`]); each call takes the next draw of the seed's stream. The device draws from its
    /// own counter-based stream, so a seed gives other (equally distributed) tokens there than
    /// [`Sampler::sample`] gives on the host.
    pub fn device_row(&mut self) -> Option<RowSampling> {
        if !self.fits_device() {
            return None;
        }
        let c = &self.cfg;
        let row = RowSampling {
            temperature: c.temperature,
            top_k: c.top_k.min(MAX_TOP_K) as u32,
            top_p: c.top_p,
            seed: c.seed,
            draw: self.device_draws,
        };
        if c.temperature > 0.0 {
            self.device_draws = self.device_draws.wrapping_add(1);
        }
        Some(row)
    }

    /// Whether [`Sampler::device_row`] gives settings (without taking a draw).
    pub fn fits_device(&self) -> bool {
        RowSampling::fits(self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)
    }

    /// Whether it always picks the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.cfg.temperature == 0.0
    }

    fn uniform(&mut self) -> f64 {
        // SplitMix64.
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token id for `logits` (non-finite logits are never chosen).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let best = argmax(logits);
        if self.cfg.temperature == 0.0 {
            return best;
        }
        let t = self.cfg.temperature;
        let scaled = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, l / t));
        let k = self.cfg.top_k;
        // With top-k, only the k best are kept: a bounded heap whose weakest member most logits fail
        // to beat is linear in the vocabulary with one comparison per logit (a full sort of Gemma 3's
        // 262144 logits took longer than its decode step, and selecting the k best in place with
        // select_nth still cost a server a large share of each step with many streams).
        // The order is total, so the kept tokens and their order are the same as a full sort's.
        let cand: Vec<(u32, f32)> = if k > 0 && k < logits.len() {
            top_k(scaled, k)
        } else {
            let mut all: Vec<(u32, f32)> = scaled.collect();
            all.sort_by(order);
            all
        };
        if cand.is_empty() {
            return best;
        }
        let m = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|&(_, l)| ((l - m) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let t: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= t);
        }
        let r = self.uniform();
        let mut acc = 0.0;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[probs.len() - 1].0
    }
}

/// The sampler's order: the higher logit first, the lower id on ties (total: ids differ).
fn order(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The `k` first candidates of `cand` in [`order`], sorted.
fn top_k(cand: impl Iterator<Item = (u32, f32)>, k: usize) -> Vec<(u32, f32)> {
    use std::cmp::Ordering;
    use std::collections::BinaryHeap;
    /// Ordered so the heap's top is the weakest kept candidate.
    struct Weakest((u32, f32));
    impl PartialEq for Weakest {
        fn eq(&self, o: &Self) -> bool {
            self.cmp(o) == Ordering::Equal
        }
    }
    impl Eq for Weakest {}
    impl PartialOrd for Weakest {
        fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Weakest {
        fn cmp(&self, o: &Self) -> Ordering {
            order(&self.0, &o.0)
        }
    }
    let mut heap: BinaryHeap<Weakest> = BinaryHeap::with_capacity(k + 1);
    for c in cand {
        if heap.len() < k {
            heap.push(Weakest(c));
        } else if let Some(mut weakest) = heap.peek_mut()
            && order(&c, &weakest.0) == Ordering::Less
        {
            weakest.0 = c;
        }
    }
    let mut kept: Vec<(u32, f32)> = heap.into_iter().map(|w| w.0).collect();
    kept.sort_by(order);
    kept
}

/// Index of the largest finite logit (ties: the lowest index, as llama.cpp and transformers pick).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_first_maximum() {
        let mut s = Sampler::new(SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(s.sample(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_keeps_the_nucleus() {
        let logits = [1.0, 5.0, 4.9, -3.0];
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 3,
        });
        assert!((0..50).all(|_| s.sample(&logits) == 1));
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.6,
            seed: 3,
        });
        for _ in 0..200 {
            let t = s.sample(&logits);
            assert!(t == 1 || t == 2, "token {t} is outside the 0.6 nucleus");
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_is_seeded() {
        let logits = [0.0f32, (3.0f32).ln()]; // probabilities 1/4, 3/4
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 9,
        });
        let ones = (0..20000).filter(|_| s.sample(&logits) == 1).count() as f64 / 20000.0;
        assert!((ones - 0.75).abs() < 0.02, "{ones}");
        let draw = |seed| {
            let mut s = Sampler::new(SamplerConfig {
                seed,
                ..Default::default()
            });
            (0..20)
                .map(|_| s.sample(&[0.0, 0.1, 0.2, 0.3]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    #[test]
    fn top_k_keeps_what_a_full_sort_keeps_in_its_order() {
        // Ties (few distinct values), non-finite logits and every k from 1 to past the vocabulary.
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        for round in 0..20 {
            let n = 1 + (next() % 300) as usize;
            let cand: Vec<(u32, f32)> = (0..n as u32)
                .map(|i| (i, (next() % (3 + round)) as f32 * 0.5 - 2.0))
                .collect();
            let mut full = cand.clone();
            full.sort_by(order);
            for k in [1, 2, 3, 7, n / 2, n - 1, n, n + 5] {
                if k == 0 {
                    continue;
                }
                let want: Vec<(u32, f32)> = full.iter().copied().take(k).collect();
                assert_eq!(top_k(cand.iter().copied(), k), want, "n {n}, k {k}");
            }
        }
        let logits = [
            f32::NAN,
            2.0,
            f32::INFINITY,
            2.0,
            -1.0,
            f32::NEG_INFINITY,
            3.0,
        ];
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 1,
        });
        for _ in 0..100 {
            let t = s.sample(&logits);
            assert!(
                t == 6 || t == 1,
                "token {t}: not one of the two best finite logits"
            );
        }
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(
            SamplerConfig {
                temperature: -1.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            SamplerConfig {
                top_p: 0.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            SamplerConfig {
                top_p: 1.5,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
    }
}
