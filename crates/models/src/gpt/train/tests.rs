use super::*;
use tinygpt_kernels::PathSet;
use tinygpt_kernels::testing::{SeedRng, assert_nmse, cpu_backend, gpu_backend};

fn tiny(dropout: f32) -> GptConfig {
    GptConfig {
        vocab_size: 11,
        block_size: 8,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        dropout,
    }
}

/// Two layers 16 wide over 16 positions: the GPU tests' model.
fn small(dropout: f32) -> GptConfig {
    GptConfig {
        vocab_size: 13,
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        dropout,
    }
}

fn batch(cfg: &GptConfig, b: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = SeedRng::new(seed);
    let ids: Vec<u32> = (0..b * cfg.block_size)
        .map(|_| rng.below(cfg.vocab_size) as u32)
        .collect();
    let tg: Vec<u32> = (0..b * cfg.block_size)
        .map(|_| rng.below(cfg.vocab_size) as u32)
        .collect();
    (ids, tg)
}

fn loss_at(cfg: &GptConfig, params: &[f32], ids: &[u32], tg: &[u32], b: usize) -> f64 {
    let be = cpu_backend();
    let mut t = Trainer::new(
        &be,
        cfg,
        b,
        params,
        None,
        OptimConfig::default(),
        PathSet::F32,
    )
    .unwrap();
    t.eval_loss(&be, ids, tg).unwrap() as f64
}

/// Gradients of the mean loss for `params`, from the backward pass.
fn grads(
    be: &Backend,
    cfg: &GptConfig,
    params: &[f32],
    ids: &[u32],
    tg: &[u32],
    b: usize,
    seed: u32,
) -> Vec<f32> {
    let mut t = Trainer::new(
        be,
        cfg,
        b,
        params,
        None,
        OptimConfig::default(),
        PathSet::F32,
    )
    .unwrap();
    t.set_batch(be, ids, tg, true).unwrap();
    t.forward(be, true, seed).unwrap();
    t.backward(be, seed).unwrap();
    t.grads_host(be).unwrap()
}

#[test]
fn every_parameter_gradient_matches_finite_differences() {
    let cfg = tiny(0.0);
    let lay = Layout::new(&cfg);
    // Larger-than-usual weights so every gradient is well above f32 noise.
    let mut params = lay.init(&cfg, 3);
    params.iter_mut().for_each(|p| *p *= 3.0);
    let b = 2;
    let (ids, tg) = batch(&cfg, b, 4);
    let g = grads(&cpu_backend(), &cfg, &params, &ids, &tg, b, 0);
    let mut rng = SeedRng::new(5);
    let diff = |i: usize, h: f32| {
        let (mut pp, mut pm) = (params.clone(), params.clone());
        pp[i] += h;
        pm[i] -= h;
        (loss_at(&cfg, &pp, &ids, &tg, b) - loss_at(&cfg, &pm, &ids, &tg, b)) / (2.0 * h as f64)
    };
    for e in &lay.entries {
        // A few entries of every parameter tensor.
        for _ in 0..4 {
            let i = e.offset + rng.below(e.len());
            // Richardson extrapolation of two central differences cancels the O(h^2) curvature term,
            // so a step large enough to stay clear of f32 rounding noise still gives an exact slope.
            let h = 4e-3f32;
            let fd = (4.0 * diff(i, h / 2.0) - diff(i, h)) / 3.0;
            let an = g[i] as f64;
            assert!(
                (fd - an).abs() <= 5e-4 + 0.01 * fd.abs(),
                "{} [{}]: finite difference {fd:.6} vs backward {an:.6}",
                e.name,
                i - e.offset
            );
        }
    }
}

#[test]
fn gpu_gradients_match_the_cpu_twin_for_every_parameter() {
    let Some(gpu) = gpu_backend(None) else { return };
    let cfg = tiny(0.1);
    let lay = Layout::new(&cfg);
    let params = lay.init(&cfg, 6);
    let b = 3;
    let (ids, tg) = batch(&cfg, b, 7);
    let gc = grads(&cpu_backend(), &cfg, &params, &ids, &tg, b, 42);
    let gg = grads(&gpu, &cfg, &params, &ids, &tg, b, 42);
    for e in &lay.entries {
        let r = e.offset..e.offset + e.len();
        assert_nmse(&e.name, &gc[r.clone()], &gg[r], 1e-9);
    }
}

#[test]
fn first_ten_steps_give_the_same_losses_on_cpu_and_gpu() {
    let Some(gpu) = gpu_backend(None) else { return };
    let cfg = small(0.1);
    let params = Layout::new(&cfg).init(&cfg, 8);
    let b = 4;
    let run = |be: &Backend| -> Vec<f32> {
        let mut t = Trainer::new(
            be,
            &cfg,
            b,
            &params,
            None,
            OptimConfig::default(),
            PathSet::F32,
        )
        .unwrap();
        (0..10)
            .map(|i| {
                let (ids, tg) = batch(&cfg, b, 100 + i);
                t.train_step(be, &ids, &tg, 1e-2, 9).unwrap();
                t.last_loss(be).unwrap()
            })
            .collect()
    };
    let (lc, lg) = (run(&cpu_backend()), run(&gpu));
    for (i, (a, b)) in lc.iter().zip(&lg).enumerate() {
        assert!(
            (a - b).abs() < 1e-4 * a.abs().max(1.0),
            "step {i}: cpu {a} gpu {b}"
        );
    }
    assert!(
        lc[9] < lc[0],
        "ten steps at lr 1e-2 should lower the loss: {lc:?}"
    );
}

#[test]
fn learning_rate_schedule_is_nanogpt_s() {
    assert!((learning_rate(0, 100, 5000, 1e-3, 1e-4) - 1e-3 / 101.0).abs() < 1e-9);
    assert!((learning_rate(100, 100, 5000, 1e-3, 1e-4) - 1e-3).abs() < 1e-9);
    assert!((learning_rate(5000, 100, 5000, 1e-3, 1e-4) - 1e-4).abs() < 1e-9);
    assert!((learning_rate(9000, 100, 5000, 1e-3, 1e-4) - 1e-4).abs() < 1e-9);
}

#[test]
fn f16_storage_forward_keeps_the_training_losses() {
    let Some(gpu) = gpu_backend(None) else { return };
    let cfg = small(0.0);
    let params = Layout::new(&cfg).init(&cfg, 8);
    let b = 4;
    let run = |be: &Backend, paths: PathSet| -> Vec<f32> {
        let optim = OptimConfig {
            f16_forward: true,
            ..OptimConfig::default()
        };
        let mut t = Trainer::new(be, &cfg, b, &params, None, optim, paths).unwrap();
        (0..6)
            .map(|i| {
                let (ids, tg) = batch(&cfg, b, 200 + i);
                t.train_step(be, &ids, &tg, 1e-2, 9).unwrap();
                t.last_loss(be).unwrap()
            })
            .collect()
    };
    let f32_losses = run(&cpu_backend(), PathSet::F32);
    let f16 = PathSet::of(&[tinygpt_kernels::PathId::F16Storage]);
    let trainer = Trainer::new(&gpu, &cfg, b, &params, None, OptimConfig::default(), f16).unwrap();
    assert!(
        trainer.paths().is_empty(),
        "without f16_forward, training leaves the f16 path off"
    );
    let f16_losses = run(&gpu, f16);
    for (i, (a, b)) in f32_losses.iter().zip(&f16_losses).enumerate() {
        assert!(
            (a - b).abs() < 2e-3 * a.abs(),
            "step {i}: f32 {a} vs f16 storage {b}"
        );
    }
}

/// On the tensor-core training path the norms' and the GELU's outputs are kept as f16 pairs: the
/// values its products stage from f32 (here the tiled kernel's f16 operands: the tensor cores need an
/// adapter that has them). Training on them gives the losses and weights of training on f32
/// activations, bit for bit.
#[test]
fn f16_activations_keep_the_tensor_core_path_s_bits() {
    let Some(gpu) = gpu_backend(None) else { return };
    let cfg = small(0.1);
    let params = Layout::new(&cfg).init(&cfg, 9);
    let b = 4;
    let mixed = PathSet::of(&[tinygpt_kernels::PathId::MixedTraining]);
    let run = |f32_acts: bool| -> (Vec<u32>, Vec<u32>) {
        let optim = OptimConfig::default();
        let mut t = Trainer::new(&gpu, &cfg, b, &params, None, optim, mixed).unwrap();
        assert!(t.paths().has(tinygpt_kernels::PathId::MixedTraining));
        if f32_acts {
            t.keep_f32_activations(&gpu).unwrap();
        }
        let losses = (0..4)
            .map(|i| {
                let (ids, tg) = batch(&cfg, b, 300 + i);
                t.train_step(&gpu, &ids, &tg, 1e-2, 9).unwrap();
                t.last_loss(&gpu).unwrap().to_bits()
            })
            .collect();
        let weights = gpu.to_vec(&t.params).unwrap();
        (losses, weights.iter().map(|w| w.to_bits()).collect())
    };
    let (pairs, wide) = (run(false), run(true));
    assert_eq!(pairs.0, wide.0, "losses");
    assert!(pairs.1 == wide.1, "weights after four steps differ");
}

/// The kernels run compiled without naga's runtime checks (indices clamped, loops bounded): two
/// training steps (dropout on) give the losses and weights of the same kernels compiled with them,
/// bit for bit, on the f32 path and on the tensor-core training path's kernels.
#[test]
fn training_gives_the_same_bits_with_and_without_shader_runtime_checks() {
    use tinygpt_kernels::testing::gpu_backend_with_checks;
    let (Some(plain), Some(checked)) = (
        gpu_backend_with_checks(false),
        gpu_backend_with_checks(true),
    ) else {
        return;
    };
    let cfg = small(0.1);
    let params = Layout::new(&cfg).init(&cfg, 5);
    let b = 4;
    let run = |gpu: &Backend, paths: PathSet| -> (Vec<u32>, Vec<u32>) {
        let optim = OptimConfig::default();
        let mut t = Trainer::new(gpu, &cfg, b, &params, None, optim, paths).unwrap();
        assert_eq!(t.paths(), paths);
        let losses = (0..2)
            .map(|i| {
                let (ids, tg) = batch(&cfg, b, 700 + i);
                t.train_step(gpu, &ids, &tg, 1e-2, 3).unwrap();
                t.last_loss(gpu).unwrap().to_bits()
            })
            .collect();
        let weights = gpu.to_vec(&t.params).unwrap();
        (losses, weights.iter().map(|w| w.to_bits()).collect())
    };
    let mixed = PathSet::of(&[tinygpt_kernels::PathId::MixedTraining]);
    for paths in [PathSet::F32, mixed] {
        let (a, c) = (run(&plain, paths), run(&checked, paths));
        assert_eq!(a.0, c.0, "losses ({paths:?})");
        assert!(a.1 == c.1, "weights after two steps differ ({paths:?})");
    }
}
