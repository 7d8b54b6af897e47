//! The drift guard on the char-level GPT (`tinygpt generate`): a planted fault that appears only from
//! position 200 on passes the start-up token gate's comparison and is caught at the first check past
//! it; a healthy fast path runs through every check with its tokens unchanged.

use tinygpt_kernels::path::Fault;
use tinygpt_kernels::testing::{assert_nmse, gpu_backend};
use tinygpt_kernels::{Backend, PathId, PathSet};
use tinygpt_models::gpt::{GptConfig, GptRunner, Layout};
use tinygpt_models::llm::{DriftEvent, DriftStats, GptDriftGuard};
use tinygpt_models::sampler::{Sampler, SamplerConfig};

fn config() -> GptConfig {
    GptConfig {
        vocab_size: 16,
        block_size: 256,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        dropout: 0.0,
    }
}

fn sampler(temperature: f32) -> Sampler {
    Sampler::new(SamplerConfig {
        temperature,
        top_k: 0,
        top_p: 1.0,
        seed: 7,
    })
}

/// `n` tokens after the prompt `[1]`, watched by a guard checking every 50 (when `guard`).
fn run(
    be: &Backend,
    runner: &mut GptRunner,
    params: &[f32],
    n: usize,
    temperature: f32,
    guard: Option<bool>,
) -> (Vec<u32>, Vec<DriftEvent>, DriftStats) {
    let mut g = guard.map(|background| {
        GptDriftGuard::new(
            &runner.cfg.clone(),
            params.to_vec(),
            50,
            Some(1),
            background,
        )
    });
    let mut s = sampler(temperature);
    let mut out = Vec::new();
    let mut events = Vec::new();
    pollster::block_on(runner.generate_guarded_async(
        be,
        &[1],
        n,
        &mut s,
        g.as_mut(),
        |e| events.push(e.clone()),
        async |t| {
            out.push(t);
            Ok(())
        },
    ))
    .unwrap();
    let stats = match &mut g {
        Some(g) => {
            if let Some(e) = g.settle(be, runner).unwrap() {
                events.push(e);
            }
            g.stats()
        }
        None => DriftStats::default(),
    };
    (out, events, stats)
}

#[test]
fn the_drift_guard_catches_a_gpt_fault_the_start_up_gates_pass() {
    let Some(be) = gpu_backend(None) else { return };
    let cfg = config();
    let params = Layout::new(&cfg).init(&cfg, 5);
    let healthy = PathSet::of(&[PathId::F16Storage]);
    let faulty = healthy.with_fault(Some(Fault::PositionsPast200));
    // The token gate's comparison: the first 150 greedy tokens agree with the healthy path's.
    let first = |paths| {
        let mut r = GptRunner::new(&be, &cfg, &params, paths).unwrap();
        run(&be, &mut r, &params, 150, 0.0, None).0
    };
    assert_eq!(first(faulty), first(healthy));
    for (temperature, background) in [(0.0, true), (0.0, false), (0.8, true), (0.8, false)] {
        let mut r = GptRunner::new(&be, &cfg, &params, faulty).unwrap();
        let (got, events, stats) = run(&be, &mut r, &params, 300, temperature, Some(background));
        let what = format!("temperature {temperature}, background {background}");
        assert_eq!(events.len(), 1, "{what}: {events:?} {stats:?}");
        let e = &events[0];
        assert_eq!(e.position, 200, "{what}: {e:?}");
        assert!(e.kl > e.bound, "{what}: {e:?}");
        assert_eq!(e.paths, faulty, "{what}");
        assert_eq!((e.checks, stats.checks), (4, 4), "{what}: {stats:?}");
        assert_eq!(r.paths(), PathSet::F32, "{what}: the fast path is off");
        assert_eq!(got.len(), 300);
        // The runner now holds its block's tokens computed on the f32 path, with its healthy weights.
        let history = r.history().to_vec();
        assert!(!history.is_empty() && history.len() <= cfg.block_size);
        assert_eq!(history[..], got[got.len() - history.len()..], "{what}");
        let mut reference = GptRunner::new(&be, &cfg, &params, PathSet::F32).unwrap();
        let want = reference.prefill(&be, &history).unwrap();
        let have = pollster::block_on(r.read_logits(&be)).unwrap();
        assert_nmse(&what, &want, &have, 1e-10);
    }
}

#[test]
fn a_healthy_gpt_fast_path_runs_through_every_check() {
    let Some(be) = gpu_backend(None) else { return };
    let cfg = config();
    let params = Layout::new(&cfg).init(&cfg, 6);
    let healthy = PathSet::of(&[PathId::F16Storage]);
    let plain = {
        let mut r = GptRunner::new(&be, &cfg, &params, healthy).unwrap();
        run(&be, &mut r, &params, 400, 0.8, None).0
    };
    for background in [true, false] {
        let mut r = GptRunner::new(&be, &cfg, &params, healthy).unwrap();
        let (got, events, stats) = run(&be, &mut r, &params, 400, 0.8, Some(background));
        assert!(events.is_empty(), "{events:?}");
        assert_eq!(stats.checks, 8, "{stats:?}");
        assert!(stats.worst_ratio < 1.0, "{stats:?}");
        assert_eq!(got, plain, "the guard does not change the tokens");
        assert_eq!(r.paths(), healthy);
    }
}
