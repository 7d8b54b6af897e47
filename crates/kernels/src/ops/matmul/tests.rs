use super::*;
use crate::testing::{SeedRng, assert_nmse, cpu_backend, gpu_backend, poisoned};

/// f32 products against an f64 reference: summation order differs, nothing else.
const BOUND: f64 = 1e-10;

fn run(be: &Backend, g: &Gemm, a: &[f32], b: &[f32], c0: &[f32], unit: [usize; 3]) -> Vec<f32> {
    let ta = be.from_f32(a, unit[0]).unwrap();
    let tb = be.from_f32(b, unit[1]).unwrap();
    let mut tc = if g.beta == 0.0 {
        poisoned(be, c0.len(), unit[2]).unwrap()
    } else {
        be.from_f32(c0, unit[2]).unwrap()
    };
    matmul(be, PathSet::F32, (&ta).into(), &tb, (&mut tc).into(), g).unwrap();
    be.to_vec(&tc).unwrap()
}

fn case(rng: &mut SeedRng, g: &Gemm) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let [ea, eb, ec] = g.extents();
    let a = rng.vec(ea, -1.0, 1.0);
    let b = rng.vec(eb, -1.0, 1.0);
    let c0 = rng.vec(ec, -1.0, 1.0);
    let mut want = c0.clone();
    gemm_reference(&a, &b, &mut want, g);
    (a, b, c0, want)
}

fn all_layouts(m: usize, n: usize, k: usize) -> [Gemm; 4] {
    [
        Gemm::nn(m, n, k),
        Gemm::nt(m, n, k),
        Gemm::tn(m, n, k),
        Gemm::tt(m, n, k),
    ]
}

/// C after the product `g` on `kernel` (forced, f32 path), from `c`.
fn run_forced(
    be: &Backend,
    kernel: Kernel,
    g: &Gemm,
    a: &Tensor,
    b: &Tensor,
    mut c: Tensor,
) -> Vec<f32> {
    let choice = Choice::forced(kernel, PathSet::F32);
    super::run(be, choice, a.into(), b.into(), (&mut c).into(), g).unwrap();
    be.to_vec(&c).unwrap()
}

/// Every layout at each of `shapes` on `be`, against the f64 reference.
fn check_layouts(be: &Backend, seed: u64, shapes: &[(usize, usize, usize)]) {
    let mut rng = SeedRng::new(seed);
    for &(m, n, k) in shapes {
        for g in all_layouts(m, n, k) {
            let (a, b, c0, want) = case(&mut rng, &g);
            let got = run(be, &g, &a, &b, &c0, [1; 3]);
            assert_nmse(&format!("{} {g:?}", be.kind()), &want, &got, BOUND);
        }
    }
}

const ODD_SIZES: [(usize, usize, usize); 5] = [
    (1, 1, 1),
    (3, 5, 7),
    (17, 33, 65),
    (64, 1, 128),
    (130, 67, 3),
];

#[test]
fn cpu_twin_matches_reference_at_odd_sizes() {
    check_layouts(&cpu_backend(), 1, &ODD_SIZES);
}

#[test]
fn gpu_matches_reference_at_odd_sizes() {
    let Some(be) = gpu_backend(None) else { return };
    check_layouts(&be, 2, &[&ODD_SIZES[..], &[(129, 257, 40)]].concat());
}

#[test]
fn gpu_large_tile_with_alpha_accumulate_and_padding() {
    let Some(be) = gpu_backend(None) else { return };
    let mut rng = SeedRng::new(3);
    // Big enough for the 128x128 tile; leading dimensions wider than the matrices; C accumulates.
    let g = Gemm::nt(300, 260, 70)
        .lda(75)
        .ldb(72)
        .ldc(263)
        .alpha(0.5)
        .accumulate();
    let (a, b, c0, want) = case(&mut rng, &g);
    assert_nmse(
        "gpu padded",
        &want,
        &run(&be, &g, &a, &b, &c0, [1; 3]),
        BOUND,
    );
    let g = Gemm::tn(260, 300, 129).alpha(-2.0);
    let (a, b, c0, want) = case(&mut rng, &g);
    assert_nmse(
        "gpu tn large",
        &want,
        &run(&be, &g, &a, &b, &c0, [1; 3]),
        BOUND,
    );
}

#[test]
fn gpu_decode_rows_take_the_gemv_kernel_and_match() {
    let Some(be) = gpu_backend(None) else { return };
    let mut rng = SeedRng::new(7);
    for (m, n, k) in [(1, 1536, 384), (2, 67, 1536), (8, 259, 40), (5, 1, 1)] {
        for g in [
            Gemm::nt(m, n, k),
            Gemm::nt(m, n, k)
                .lda(k + 3)
                .ldc(n + 1)
                .alpha(0.5)
                .accumulate(),
        ] {
            let (a, b, c0, want) = case(&mut rng, &g);
            assert_nmse(
                &format!("gemv {g:?}"),
                &want,
                &run(&be, &g, &a, &b, &c0, [1; 3]),
                BOUND,
            );
        }
    }
}

#[test]
fn batched_attention_shaped_products() {
    // Scores = Q Kᵀ per (sequence, head), read straight out of a fused QKV tensor [B*T, 3C].
    let (bsz, t, h, hd) = (3, 9, 2, 4);
    let c = h * hd;
    let g = Gemm::nt(t, t, hd).lda(3 * c).ldb(3 * c).alpha(0.5).batched(
        [bsz, h],
        [t * 3 * c, hd],
        [t * 3 * c, hd],
        [h * t * t, t * t],
    );
    let mut rng = SeedRng::new(4);
    let qkv = rng.vec(bsz * t * 3 * c, -1.0, 1.0);
    let ec = g.extents()[2];
    let mut want = vec![0.0; ec];
    gemm_reference(&qkv, &qkv[c..], &mut want, &g);
    let mut backends = vec![cpu_backend()];
    backends.extend(gpu_backend(None));
    for be in &backends {
        let tq = be.from_f32(&qkv, t * 3 * c).unwrap();
        let mut ts = poisoned(be, ec, t * t).unwrap();
        matmul(be, PathSet::F32, tq.at(0), tq.at(c), (&mut ts).into(), &g).unwrap();
        assert_nmse(
            &format!("{} batched", be.kind()),
            &want,
            &be.to_vec(&ts).unwrap(),
            BOUND,
        );
    }
}

#[test]
fn gpu_splits_tensors_larger_than_a_binding() {
    // Chunks of 4 KiB (1024 floats) force every operand across several buffers.
    let Some(be) = gpu_backend(Some(4096)) else {
        return;
    };
    let mut rng = SeedRng::new(5);
    for g in [
        Gemm::nn(70, 40, 50),
        Gemm::nt(33, 90, 37),
        Gemm::tn(41, 29, 100),
        Gemm::tt(20, 45, 61),
        Gemm::nt(50, 60, 30).accumulate(),
    ] {
        let (a, b, c0, want) = case(&mut rng, &g);
        let units = [g.lda, g.ldb, g.ldc];
        let got = run(&be, &g, &a, &b, &c0, units);
        assert_nmse(&format!("split {g:?}"), &want, &got, BOUND);
    }
    // A batched product whose outer batch entries sit in different buffers.
    let g = Gemm::nn(16, 16, 16).batched([6, 2], [512, 256], [512, 256], [512, 256]);
    let (a, b, c0, want) = case(&mut rng, &g);
    let got = run(&be, &g, &a, &b, &c0, [512; 3]);
    assert_nmse("split batched", &want, &got, BOUND);
}

#[test]
fn gpu_weight_larger_than_the_real_binding_limit() {
    // Under the low-end profile one binding holds 128 MiB; this 160 MiB weight (an LM head's size) must
    // be split, not refused.
    let Some(be) = crate::testing::gpu_backend_low_end() else {
        return;
    };
    let (m, n, k) = (2, 65536, 640);
    let mut rng = SeedRng::new(6);
    let x = rng.vec(m * k, -1.0, 1.0);
    let w = rng.vec(n * k, -0.1, 0.1);
    let g = Gemm::nt(m, n, k);
    let tw = be.from_f32(&w, k).unwrap();
    assert!(
        tw.gpu().unwrap().num_chunks() > 1,
        "the weight should need several buffers"
    );
    let tx = be.from_f32(&x, k).unwrap();
    let mut ty = poisoned(&be, m * n, n).unwrap();
    matmul(&be, PathSet::F32, (&tx).into(), &tw, (&mut ty).into(), &g).unwrap();
    let mut want = vec![0.0; m * n];
    let cpu = cpu_backend();
    let (cx, cw) = (cpu.from_f32(&x, k).unwrap(), cpu.from_f32(&w, k).unwrap());
    let mut cy = cpu.zeros(m * n, n).unwrap();
    matmul(&cpu, PathSet::F32, (&cx).into(), &cw, (&mut cy).into(), &g).unwrap();
    want.copy_from_slice(&cpu.to_vec(&cy).unwrap());
    assert_nmse("160 MiB weight", &want, &be.to_vec(&ty).unwrap(), BOUND);
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let be = cpu_backend();
    let a = be.zeros(10, 1).unwrap();
    let b = be.zeros(10, 1).unwrap();
    let mut c = be.zeros(10, 1).unwrap();
    // Too few elements for a 4x4x4 product.
    let e = matmul(
        &be,
        PathSet::F32,
        (&a).into(),
        &b,
        (&mut c).into(),
        &Gemm::nn(4, 4, 4),
    );
    assert!(matches!(e, Err(Error::Shape { .. })), "{e:?}");
    // Leading dimension smaller than the row.
    let e = matmul(
        &be,
        PathSet::F32,
        (&a).into(),
        &b,
        (&mut c).into(),
        &Gemm::nn(2, 2, 3).lda(2),
    );
    assert!(matches!(e, Err(Error::Shape { .. })), "{e:?}");
}

mod fuzz {
    use super::*;
    use crate::testing::SeedRng;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]
        #[test]
        fn random_shapes_match_reference(m in 1usize..80, n in 1usize..80, k in 0usize..80,
                                         ta: bool, tb: bool, acc: bool, seed: u64) {
            let mut g = Gemm::new(m, n, k, ta, tb);
            if acc { g = g.accumulate(); }
            let mut rng = SeedRng::new(seed);
            let (a, b, c0, want) = case(&mut rng, &g);
            let cpu = cpu_backend();
            assert_nmse("cpu fuzz", &want, &run(&cpu, &g, &a, &b, &c0, [1; 3]), BOUND);
            if let Some(be) = gpu_backend(None) {
                assert_nmse("gpu fuzz", &want, &run(&be, &g, &a, &b, &c0, [1; 3]), BOUND);
            }
        }
    }
}

/// The tiled kernel in both forms (with workgroup tiles and barriers, and barrier-free for CPU-type
/// adapters), each tile, every layout, batched and split products, f32 and f16 B: the same bits, and
/// both right. On a software adapter `choose` takes the direct form, so this keeps the tiled one (what
/// hardware GPUs run) tested there too.
#[test]
fn gpu_direct_and_tiled_forms_give_the_same_bits() {
    let Some(be) = gpu_backend(None) else { return };
    let mut rng = SeedRng::new(11);
    let mut gemms: Vec<Gemm> = [(1, 1, 1), (17, 33, 65), (130, 67, 3), (64, 96, 40)]
        .into_iter()
        .flat_map(|(m, n, k)| all_layouts(m, n, k))
        .collect();
    gemms.push(Gemm::nt(40, 36, 24).batched(
        [2, 3],
        [3 * 40 * 24, 40 * 24],
        [3 * 36 * 24, 36 * 24],
        [3 * 40 * 36, 40 * 36],
    ));
    gemms.push(Gemm::nn(70, 50, 30).alpha(0.5).accumulate());
    for g in &gemms {
        let (a, b, c0, want) = case(&mut rng, g);
        let ta = be.from_f32(&a, 1).unwrap();
        let tb = be.from_f32(&b, 1).unwrap();
        let mut outs = Vec::new();
        for tile in [TILE_SMALL, TILE_MEDIUM, TILE_LARGE] {
            for direct in [false, true] {
                let kernel = Kernel::Tiled {
                    tile,
                    shader_f16: false,
                    direct,
                };
                let got = run_forced(&be, kernel, g, &ta, &tb, be.from_f32(&c0, 1).unwrap());
                assert_nmse(
                    &format!("{g:?} {} direct={direct}", tile.key()),
                    &want,
                    &got,
                    BOUND,
                );
                outs.push((tile.key(), direct, got));
            }
        }
        for pair in outs.chunks(2) {
            let (tiled, direct) = (&pair[0].2, &pair[1].2);
            let same = tiled.iter().zip(direct).all(|(x, y)| x == y);
            assert!(same, "{g:?} tile {}: the two forms differ", pair[0].0);
        }
    }
}

/// Training's weight gradients (few output tiles, K = 16384) split K; products with enough tiles or a
/// short K do not; the partial products stay within their budget.
#[test]
fn split_k_takes_long_thin_products() {
    let k = 16384;
    let max = 16 << 20;
    assert_eq!(split_slices(&Gemm::tn(384, 384, k), max), Some(32));
    assert_eq!(split_slices(&Gemm::tn(1152, 384, k), max), Some(32));
    assert_eq!(split_slices(&Gemm::tn(1536, 384, k), max), Some(16));
    // A smaller budget takes fewer slices.
    assert_eq!(split_slices(&Gemm::tn(1152, 384, k), 4 << 20), Some(8));
    assert_eq!(split_slices(&Gemm::tn(384, 384, 2048), max), None);
    assert_eq!(split_slices(&Gemm::nn(4096, 4096, 4096), max), None);
    let batched =
        Gemm::nn(64, 64, 8192).batched([1, 2], [0, 64 * 8192], [0, 64 * 8192], [0, 64 * 64]);
    assert_eq!(split_slices(&batched, max), None);
}

/// The split-K kernel in every layout, with a K that the slices do not divide, alpha and an
/// accumulated C, against the f64 reference.
#[test]
fn gpu_split_k_matches_reference() {
    let Some(be) = gpu_backend(None) else { return };
    let mut rng = SeedRng::new(12);
    let mut gemms: Vec<(Gemm, usize)> = all_layouts(40, 72, 4100)
        .into_iter()
        .map(|g| (g, 8))
        .collect();
    gemms.push((Gemm::tn(17, 9, 1031).alpha(0.5).accumulate(), 4));
    gemms.push((Gemm::nn(3, 130, 600).alpha(-2.0), 3));
    for (g, splits) in &gemms {
        let (a, b, c0, want) = case(&mut rng, g);
        let ta = be.from_f32(&a, 1).unwrap();
        let tb = be.from_f32(&b, 1).unwrap();
        let tc = if g.beta == 0.0 {
            poisoned(&be, c0.len(), 1).unwrap()
        } else {
            be.from_f32(&c0, 1).unwrap()
        };
        let got = run_forced(
            &be,
            Kernel::SplitK {
                splits: *splits,
                mixed: false,
            },
            g,
            &ta,
            &tb,
            tc,
        );
        assert_nmse(&format!("{g:?} in {splits} slices"), &want, &got, BOUND);
    }
}

/// The mixed-precision tensor-core kernel on every tile shape it has, every layout, odd and whole
/// tiles, batched with offsets, scaled (alpha) and accumulating (beta), against the f64 reference
/// within f16 operand rounding. Runs where the adapter has cooperative matrices (the tensor-core
/// training path exists nowhere else).
#[test]
fn tensor_core_tiles_match_reference() {
    let Some(be) = gpu_backend(None) else { return };
    let Some(gb) = be.as_gpu() else { return };
    if !gb.has_feature(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        eprintln!("the adapter has no cooperative matrices: nothing to run");
        return;
    }
    let room = gb.limits.max_compute_workgroup_storage_size as usize;
    let mixed = PathSet::of(&[PathId::MixedTraining]);
    let mut rng = SeedRng::new(11);
    // f16 operands (11-bit significands) over K up to 300: the error's energy is ~1e-7 of the output's.
    let bound = 1e-5;
    for tile in MixedTile::CANDIDATES {
        if tile.shared_bytes() > room {
            continue;
        }
        for (m, n, k) in [(16, 16, 16), (128, 128, 64), (130, 67, 33), (200, 300, 100)] {
            for g in all_layouts(m, n, k) {
                let g = g.alpha(0.5);
                let [ea, eb, ec] = g.extents();
                // Two batches side by side, each operand starting past an offset of 3 elements.
                let g = g.batched([2, 1], [ea + 5, 0], [eb + 7, 0], [ec + 2, 0]);
                for g in [g, g.accumulate()] {
                    let (a, b, c0, want) = case(&mut rng, &g);
                    let pad = |v: &[f32]| [vec![9.0; 3], v.to_vec()].concat();
                    let ta = be.from_f32(&pad(&a), 1).unwrap();
                    let tb = be.from_f32(&pad(&b), 1).unwrap();
                    let mut tc = be.from_f32(&pad(&c0), 1).unwrap();
                    let choice = Choice::forced(Kernel::CoopMixed(tile), mixed);
                    let (va, vb) = (TRef::from(&ta).shift(3), TRef::from(&tb).shift(3));
                    super::run(&be, choice, va, Weights::F32(vb), tc.at_mut(3), &g).unwrap();
                    let got = be.to_vec(&tc).unwrap();
                    assert_eq!(&got[..3], &[9.0; 3], "{} wrote before C", tile.key());
                    assert_nmse(&format!("{} {g:?}", tile.key()), &want, &got[3..], bound);
                }
            }
        }
        // Causal skips keep the bits of the whole computation (see causal_skips_keep_the_bits).
        for (g, a, b) in causal_cases(&mut rng, 200, 40) {
            let (ta, tb) = (be.from_f32(&a, 1).unwrap(), be.from_f32(&b, 1).unwrap());
            let [_, _, ec] = g.extents();
            let kernel = Kernel::CoopMixed(tile);
            let whole = Gemm {
                causal: Causal::None,
                ..g
            };
            let run_on = |g: &Gemm| {
                let mut c = poisoned(&be, ec, 1).unwrap();
                let choice = Choice::forced(kernel, mixed);
                super::run(&be, choice, (&ta).into(), (&tb).into(), (&mut c).into(), g).unwrap();
                be.to_vec(&c).unwrap()
            };
            let (want, got) = (run_on(&whole), run_on(&g));
            assert_causal_bits(&g, 200, &want, &got, &tile.key());
        }
    }
}

/// A batch of `t` x `t` causal matrices with `d`-wide operands for each [`Causal`] structure, the
/// causal operand zero where the structure says (as attention's masked probabilities are).
fn causal_cases(rng: &mut SeedRng, t: usize, d: usize) -> Vec<(Gemm, Vec<f32>, Vec<f32>)> {
    let batch =
        |g: Gemm, sa: usize, sb: usize, sc: usize| g.batched([2, 1], [sa, 0], [sb, 0], [sc, 0]);
    let mut cases = Vec::new();
    // Scores: C = Q·Kᵀ, only C's lower triangle wanted.
    let g = batch(
        Gemm::nt(t, t, d).causal(Causal::Output),
        t * d,
        t * d,
        t * t,
    );
    let [ea, eb, _] = g.extents();
    cases.push((g, rng.vec(ea, -1.0, 1.0), rng.vec(eb, -1.0, 1.0)));
    // P·V (A lower-triangular) and Pᵀ·dY (A stored t x t, op(A) = Aᵀ upper-triangular).
    for g in [
        Gemm::nn(t, d, t).causal(Causal::ALower),
        Gemm::tn(t, d, t).causal(Causal::AUpper),
    ] {
        let g = batch(g, t * t, t * d, t * d);
        let [ea, eb, _] = g.extents();
        let mut a = rng.vec(ea, -1.0, 1.0);
        for (idx, v) in a.iter_mut().enumerate() {
            // Stored A[i][j] (rows i of t): zero above the diagonal in both cases (P is lower).
            let (i, j) = ((idx % (t * t)) / t, idx % t);
            if j > i {
                *v = 0.0;
            }
        }
        cases.push((g, a, rng.vec(eb, -1.0, 1.0)));
    }
    cases
}

/// `got` (the product `g` with its causal skips) is bit for bit `want` (the same kernel computing
/// everything), on C's lower triangle only for `Causal::Output`; `t` is the causal matrices' size.
fn assert_causal_bits(g: &Gemm, t: usize, want: &[f32], got: &[f32], kernel: &str) {
    for (idx, (w, v)) in want.iter().zip(got).enumerate() {
        let (i, j) = ((idx % (t * t)) / t, idx % t);
        if g.causal == Causal::Output && j > i {
            continue;
        }
        assert_eq!(
            w.to_bits(),
            v.to_bits(),
            "{:?} t={t} {kernel} at {idx}",
            g.causal
        );
    }
}

/// The tiled kernels given a causal structure skip tiles and k-steps, and the values they write are
/// bit for bit those of the same kernel computing everything (the skipped terms are exact zeros;
/// for `Causal::Output`, on C's lower triangle, the only part wanted). Every tile shape, odd sizes.
#[test]
fn causal_skips_keep_the_bits() {
    let Some(be) = gpu_backend(None) else { return };
    let mut rng = SeedRng::new(21);
    for (t, d) in [(200, 40), (33, 16)] {
        for (g, a, b) in causal_cases(&mut rng, t, d) {
            let ta = be.from_f32(&a, 1).unwrap();
            let tb = be.from_f32(&b, 1).unwrap();
            let [_, _, ec] = g.extents();
            for tile in [TILE_LARGE, TILE_TALL, TILE_MEDIUM, TILE_SMALL] {
                let kernel = Kernel::Tiled {
                    tile,
                    shader_f16: false,
                    direct: false,
                };
                let whole = Gemm {
                    causal: Causal::None,
                    ..g
                };
                let c0 = poisoned(&be, ec, 1).unwrap();
                let want = run_forced(&be, kernel, &whole, &ta, &tb, c0);
                let c0 = poisoned(&be, ec, 1).unwrap();
                let got = run_forced(&be, kernel, &g, &ta, &tb, c0);
                assert_causal_bits(&g, t, &want, &got, &format!("tile {}", tile.key()));
            }
        }
    }
}

/// Operands stored as f16 pairs: the tensor-core kernel on every tile shape and layout, batched
/// with word offsets, scaled and accumulating, gives the bits of the f32-operand kernel on the f32
/// values the pairs hold (the same f16 values staged, the same fragments and sums), and the CPU twin
/// agrees within f32 rounding of the order of sums. The GPU part runs where the adapter has
/// cooperative matrices.
#[test]
fn f16_operands_match_the_f32_operand_kernel() {
    let mut rng = SeedRng::new(12);
    let mixed = PathSet::of(&[PathId::MixedTraining]);
    let cases = |rng: &mut SeedRng| {
        let mut v = Vec::new();
        for (m, n, k) in [(16, 16, 16), (128, 128, 64), (130, 68, 34), (200, 300, 100)] {
            for g in all_layouts(m, n, k) {
                let g = g.alpha(0.5);
                let [ea, eb, ec] = g.extents();
                // Two batches, each operand's batch stride even and its view two words in.
                let even = |e: usize| e + e % 2 + 2;
                let g = g.batched([2, 1], [even(ea), 0], [even(eb), 0], [ec + 2, 0]);
                for g in [g, g.accumulate()] {
                    let (a, b, c0, _) = case(rng, &g);
                    // The f16 values the pairs will hold, as f32.
                    let round = |v: Vec<f32>| {
                        v.into_iter()
                            .map(|x| half::f16::from_f32(x).to_f32())
                            .collect::<Vec<_>>()
                    };
                    v.push((g, round(a), round(b), c0));
                }
            }
        }
        v
    };
    let cpu = cpu_backend();
    let gpu = gpu_backend(None).filter(|be| {
        be.as_gpu()
            .is_some_and(|g| g.has_feature(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX))
    });
    let tiles: Vec<Option<MixedTile>> = match &gpu {
        Some(be) => {
            let room = be
                .as_gpu()
                .unwrap()
                .limits
                .max_compute_workgroup_storage_size as usize;
            std::iter::once(None)
                .chain(
                    MixedTile::CANDIDATES
                        .into_iter()
                        .filter(|t| t.shared_bytes() <= room)
                        .map(Some),
                )
                .collect()
        }
        None => vec![None],
    };
    for (g, a, b, c0) in cases(&mut rng) {
        let pad = |v: &[f32]| [vec![7.0; 4], v.to_vec()].concat();
        let packed = |be: &crate::Backend, v: &[f32]| {
            let t = be.from_f32(&pad(v), 1).unwrap();
            let mut p = be.zeros(packed_len(v.len() + 4), 1).unwrap();
            super::pack_f16(be, (&t).into(), (&mut p).into(), v.len() + 4).unwrap();
            p
        };
        // C after the product on f16 pairs packed from a and b (each view two words in).
        let f16_product = |be: &crate::Backend, tile: Option<MixedTile>| {
            let (pa, pb) = (packed(be, &a), packed(be, &b));
            let mut c = be.from_f32(&c0, 1).unwrap();
            super::matmul_f16_operands(
                be,
                TRef::from(&pa).shift(2),
                TRef::from(&pb).shift(2),
                (&mut c).into(),
                &g,
                tile,
            )
            .unwrap();
            be.to_vec(&c).unwrap()
        };
        // The CPU twin against the f64 reference of the rounded values.
        let mut want = c0.clone();
        gemm_reference(&a, &b, &mut want, &g);
        assert_nmse(
            &format!("cpu {g:?}"),
            &want,
            &f16_product(&cpu, None),
            1e-12,
        );
        let Some(be) = &gpu else { continue };
        let (ta, tb) = (be.from_f32(&a, 1).unwrap(), be.from_f32(&b, 1).unwrap());
        for &tile in &tiles {
            let got = f16_product(be, tile);
            let mut c32 = be.from_f32(&c0, 1).unwrap();
            let kernel = match tile {
                Some(t) => Kernel::CoopMixed(t),
                None => {
                    super::choose(
                        be,
                        (&ta).into(),
                        (&tb).into(),
                        &(&mut c32).into(),
                        &g,
                        mixed,
                    )
                    .kernel
                }
            };
            let choice = Choice::forced(kernel, mixed);
            super::run(
                be,
                choice,
                (&ta).into(),
                (&tb).into(),
                (&mut c32).into(),
                &g,
            )
            .unwrap();
            assert_eq!(
                got,
                be.to_vec(&c32).unwrap(),
                "{} {g:?}",
                tile.map_or("the chosen tile".into(), |t| t.key())
            );
        }
    }
}

/// f16 weights on the tensor-core training path (training's block matrices, packed once a step): in
/// every layout, unbatched and batched, scaled and accumulating, the product on the packed copy gives
/// the bits of the same path on the f32 values the copy holds (the same f16 values staged), on the
/// kernel the path chooses: the tensor-core kernel with f16 B where the adapter has cooperative
/// matrices (an odd n takes the tiled kernel there), the tiled kernel's f16-operand form elsewhere.
/// The CPU twin agrees within f32 rounding of the order of sums.
#[test]
fn f16_weights_on_the_training_path_keep_the_bits() {
    let mut rng = SeedRng::new(13);
    let mixed = PathSet::of(&[PathId::MixedTraining]);
    let mut backends = vec![cpu_backend()];
    backends.extend(gpu_backend(None));
    for (m, n, k) in [(16, 16, 16), (130, 68, 34), (200, 300, 100), (64, 65, 48)] {
        // f16 weights need an even row length: an odd n only where k is B's row length.
        for g in all_layouts(m, n, k).into_iter().filter(|g| g.ldb % 2 == 0) {
            let [ea, eb, ec] = g.extents();
            let batched = g.batched([2, 1], [ea + 3, 0], [eb + eb % 2, 0], [ec, 0]);
            for g in [g.alpha(0.5), batched.accumulate()] {
                let (a, b, c0, _) = case(&mut rng, &g);
                let b: Vec<f32> = b
                    .into_iter()
                    .map(|x| half::f16::from_f32(x).to_f32())
                    .collect();
                let mut want = c0.clone();
                gemm_reference(&a, &b, &mut want, &g);
                for be in &backends {
                    let ta = be.from_f32(&a, 1).unwrap();
                    let tb = be.from_f32(&b, 1).unwrap();
                    let mut pb = be.zeros(packed_len(b.len()), 1).unwrap();
                    super::pack_f16(be, (&tb).into(), (&mut pb).into(), b.len()).unwrap();
                    let w16 = Weights::F16((&pb).into());
                    let product = |w: Weights<'_>, kernel: Choice| {
                        let mut c = be.from_f32(&c0, 1).unwrap();
                        super::run(be, kernel, (&ta).into(), w, (&mut c).into(), &g).unwrap();
                        be.to_vec(&c).unwrap()
                    };
                    let mut c = be.from_f32(&c0, 1).unwrap();
                    let choice = super::choose(be, (&ta).into(), w16, &(&mut c).into(), &g, mixed);
                    let k16 = choice.kernel;
                    let got = product(w16, choice);
                    let what = format!("{} {g:?} on {k16:?}", be.kind());
                    if be.as_gpu().is_none() {
                        assert_nmse(&what, &want, &got, 1e-12);
                        continue;
                    }
                    let coop = be.as_gpu().is_some_and(|gb| {
                        gb.has_feature(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
                    });
                    let tiled_f16 = matches!(
                        k16,
                        Kernel::Tiled {
                            shader_f16: true,
                            ..
                        }
                    );
                    if coop && n % 2 == 0 {
                        assert!(matches!(k16, Kernel::CoopMixed(_)), "{what}");
                    } else {
                        assert!(tiled_f16, "{what}");
                    }
                    // The same kernel on the f32 values the copy holds.
                    assert_eq!(got, product((&tb).into(), choice), "{what}");
                }
            }
        }
    }
}

/// A stored as f16 pairs (training's activations and output gradients on the tensor-core path): in
/// every layout, with f32 and f16 B, unbatched and batched, split over slices of K or not, the product
/// gives the bits of the training path's product on the f32 values the pairs hold (on the tensor cores
/// the same f16 values are staged; elsewhere A is unpacked and the same kernel runs); the CPU twin
/// agrees with the f64 reference.
#[test]
fn f16_activations_keep_the_bits() {
    let mut rng = SeedRng::new(14);
    let mixed = PathSet::of(&[PathId::MixedTraining]);
    let mut backends = vec![cpu_backend()];
    backends.extend(gpu_backend(None));
    // K = 4096: a single product splits over slices of K on a hardware adapter.
    for (m, n, k) in [(16, 16, 16), (130, 68, 34), (200, 300, 100), (32, 48, 4096)] {
        for g in all_layouts(m, n, k) {
            let [ea, eb, ec] = g.extents();
            let even = |e: usize| e + e % 2;
            let batched = g.batched([2, 1], [even(ea) + 2, 0], [even(eb), 0], [ec, 0]);
            let forms = [
                (g.alpha(0.5), false),
                (g, true),
                (batched.accumulate(), true),
            ];
            for (g, b16) in forms {
                let (a, b, c0, _) = case(&mut rng, &g);
                let round = |v: Vec<f32>| -> Vec<f32> {
                    v.into_iter()
                        .map(|x| half::f16::from_f32(x).to_f32())
                        .collect()
                };
                let (a, b) = (round(a), if b16 { round(b) } else { b });
                let mut want = c0.clone();
                gemm_reference(&a, &b, &mut want, &g);
                for be in &backends {
                    let packed = |v: &[f32]| {
                        let t = be.from_f32(v, 1).unwrap();
                        let mut p = be.zeros(packed_len(v.len()), 1).unwrap();
                        super::pack_f16(be, (&t).into(), (&mut p).into(), v.len()).unwrap();
                        (t, p)
                    };
                    let ((ta, pa), (tb, pb)) = (packed(&a), packed(&b));
                    let wb = |t| {
                        if b16 {
                            Weights::F16(t)
                        } else {
                            Weights::F32(t)
                        }
                    };
                    let mut c = be.from_f32(&c0, 1).unwrap();
                    let b_arg = wb((if b16 { &pb } else { &tb }).into());
                    super::matmul_f16_a(be, mixed, (&pa).into(), b_arg, (&mut c).into(), &g)
                        .unwrap();
                    let got = be.to_vec(&c).unwrap();
                    let what = format!("{} {g:?} f16 B {b16}", be.kind());
                    if be.as_gpu().is_none() {
                        assert_nmse(&what, &want, &got, 1e-12);
                        continue;
                    }
                    let mut c32 = be.from_f32(&c0, 1).unwrap();
                    matmul(be, mixed, (&ta).into(), b_arg, (&mut c32).into(), &g).unwrap();
                    assert_eq!(got, be.to_vec(&c32).unwrap(), "{what}");
                }
            }
        }
    }
}

/// Split-K over slices of K with B stored as f16 pairs (a weight gradient whose input is training's
/// f16 activation) gives the bits of the same split on the f32 values the pairs hold, for slices of
/// even K (the splits training's products take: on the tensor cores a slice of odd K cannot stage
/// f16 pairs and takes the tiled kernel).
#[test]
fn split_k_takes_f16_b() {
    let mut rng = SeedRng::new(15);
    let Some(be) = gpu_backend(None) else { return };
    let mixed = PathSet::of(&[PathId::MixedTraining]);
    for g in [Gemm::tn(96, 64, 1032), Gemm::nn(40, 66, 708).alpha(-2.0)] {
        let (a, b, c0, _) = case(&mut rng, &g);
        let b: Vec<f32> = b
            .into_iter()
            .map(|x| half::f16::from_f32(x).to_f32())
            .collect();
        let ta = be.from_f32(&a, 1).unwrap();
        let tb = be.from_f32(&b, 1).unwrap();
        let mut pb = be.zeros(packed_len(b.len()), 1).unwrap();
        super::pack_f16(&be, (&tb).into(), (&mut pb).into(), b.len()).unwrap();
        for splits in [2, 3] {
            let choice = Choice::forced(
                Kernel::SplitK {
                    splits,
                    mixed: true,
                },
                mixed,
            );
            let product = |w: Weights<'_>| {
                let mut c = be.from_f32(&c0, 1).unwrap();
                super::run(&be, choice, (&ta).into(), w, (&mut c).into(), &g).unwrap();
                be.to_vec(&c).unwrap()
            };
            let got = product(Weights::F16((&pb).into()));
            assert_eq!(got, product((&tb).into()), "{g:?} in {splits} slices");
        }
    }
}

/// A tensor's words, for comparing bits (f16 pairs among them).
fn bits(be: &Backend, t: &Tensor) -> Vec<u32> {
    be.to_vec(t).unwrap().iter().map(|v| v.to_bits()).collect()
}

/// `v` packed into f16 pairs on `be`.
fn pairs_of(be: &Backend, v: &[f32]) -> Tensor {
    let t = be.from_f32(v, 1).unwrap();
    let mut p = be.zeros(packed_len(v.len()), 1).unwrap();
    super::pack_f16(be, (&t).into(), (&mut p).into(), v.len()).unwrap();
    p
}

/// The GELU epilogues: c_fc's product with its activation (`matmul_f16_a_gelu`) and mlp_proj's dX
/// product with GELU's backward (`matmul_f16_a_gelu_backward`), A and B as f16 pairs, give the bits
/// of the product followed by the element-wise op, on every backend: on an adapter with cooperative
/// matrices one tensor-core product writes both (views at word offsets inside their tensors); where
/// the layout does not suit the epilogue (an f32 C at an odd offset) the two ops run one after the
/// other. The words around each view are left alone.
#[test]
fn gelu_epilogues_give_the_bits_of_the_ops_one_by_one() {
    use crate::ops::gelu::{gelu_backward_f16, gelu_f16};
    let mut rng = SeedRng::new(16);
    let mixed = PathSet::of(&[PathId::MixedTraining]);
    let mut backends = vec![cpu_backend()];
    backends.extend(gpu_backend(None));
    for (m, n, k) in [(130, 68, 34), (256, 384, 128), (64, 16, 48)] {
        // c_fc's x·Wᵀ and mlp_proj's dY·W, W as the trainer's f16 copy.
        for g in [Gemm::nt(m, n, k), Gemm::nn(m, n, k)] {
            let [ea, eb, ec] = g.extents();
            let a = rng.vec(ea, -1.0, 1.0);
            let b = rng.vec(eb, -1.0, 1.0);
            let pre0 = rng.vec(ec, -5.0, 5.0);
            for be in &backends {
                let (pa, pb) = (pairs_of(be, &a), pairs_of(be, &b));
                let w = || Weights::F16((&pb).into());
                let pairs = || be.zeros(packed_len(ec) + 4, 1).unwrap();
                for pre_at in [2, 1] {
                    let what = format!("{} {g:?} C at {pre_at}", be.kind());
                    // Forward: the product and its GELU.
                    let mut pre = be.zeros(ec + 4, 1).unwrap();
                    let mut act = pairs();
                    super::matmul_f16_a_gelu(
                        be,
                        mixed,
                        (&pa).into(),
                        w(),
                        pre.at_mut(pre_at),
                        act.at_mut(2),
                        &g,
                    )
                    .unwrap();
                    let mut pre1 = be.zeros(ec + 4, 1).unwrap();
                    let mut act1 = pairs();
                    super::matmul_f16_a(be, mixed, (&pa).into(), w(), pre1.at_mut(pre_at), &g)
                        .unwrap();
                    gelu_f16(be, pre1.at(pre_at), act1.at_mut(2), ec).unwrap();
                    assert_eq!(bits(be, &pre), bits(be, &pre1), "pre-activations, {what}");
                    assert_eq!(bits(be, &act), bits(be, &act1), "activations, {what}");
                    // Backward: the product times GELU's derivative at pre0.
                    let tpre = be
                        .from_f32(&[vec![3.0; 4], pre0.clone()].concat(), 1)
                        .unwrap();
                    let mut dpre = pairs();
                    super::matmul_f16_a_gelu_backward(
                        be,
                        mixed,
                        (&pa).into(),
                        w(),
                        tpre.at(pre_at),
                        dpre.at_mut(2),
                        &g,
                    )
                    .unwrap();
                    let mut wide = be.zeros(ec, 1).unwrap();
                    super::matmul_f16_a(be, mixed, (&pa).into(), w(), wide.at_mut(0), &g).unwrap();
                    let mut dpre1 = pairs();
                    gelu_backward_f16(be, tpre.at(pre_at), wide.at(0), dpre1.at_mut(2), ec)
                        .unwrap();
                    assert_eq!(bits(be, &dpre), bits(be, &dpre1), "gradients, {what}");
                }
            }
        }
    }
    // A product the fused forms do not take: C with a row stride of its own.
    let be = cpu_backend();
    let g = Gemm {
        ldc: 20,
        ..Gemm::nt(8, 16, 8)
    };
    let t = be.zeros(256, 1).unwrap();
    let mut c = be.zeros(256, 1).unwrap();
    let mut e = be.zeros(256, 1).unwrap();
    let r = super::matmul_f16_a_gelu(&be, mixed, t.at(0), t.at(0), c.at_mut(0), e.at_mut(0), &g);
    assert!(r.is_err());
}

/// The dropout epilogue (a projection's branch joining the residual stream,
/// `matmul_f16_a_dropout_add`): with and without dropout, the bits of the product followed by
/// `dropout_add` (the same mask), on every backend; on an adapter with cooperative matrices one
/// tensor-core product, where the layout suits it (an output at an odd offset: the two ops).
#[test]
fn dropout_epilogue_gives_the_bits_of_the_ops_one_by_one() {
    use crate::ops::dropout::dropout_add;
    let mut rng = SeedRng::new(17);
    let mixed = PathSet::of(&[PathId::MixedTraining]);
    let mut backends = vec![cpu_backend()];
    backends.extend(gpu_backend(None));
    for (m, n, k) in [(130, 68, 34), (256, 384, 128)] {
        let g = Gemm::nt(m, n, k);
        let [ea, eb, ec] = g.extents();
        let a = rng.vec(ea, -1.0, 1.0);
        let b = rng.vec(eb, -1.0, 1.0);
        let residual = rng.vec(ec + 4, -1.0, 1.0);
        for be in &backends {
            let (pa, pb) = (pairs_of(be, &a), pairs_of(be, &b));
            let w = || Weights::F16((&pb).into());
            let tr = be.from_f32(&residual, 1).unwrap();
            for ((p, seed), at) in [((0.2, 7u32), 2), ((0.0, 0), 2), ((0.1, 9), 1)] {
                let what = format!("{} {g:?} p {p} out at {at}", be.kind());
                let mut out = be.zeros(ec + 4, 1).unwrap();
                super::matmul_f16_a_dropout_add(
                    be,
                    mixed,
                    (&pa).into(),
                    w(),
                    tr.at(4 - at),
                    out.at_mut(at),
                    &g,
                    (p, seed),
                )
                .unwrap();
                let mut wide = be.zeros(ec, 1).unwrap();
                super::matmul_f16_a(be, mixed, (&pa).into(), w(), wide.at_mut(0), &g).unwrap();
                let mut out1 = be.zeros(ec + 4, 1).unwrap();
                dropout_add(be, tr.at(4 - at), wide.at(0), out1.at_mut(at), ec, p, seed).unwrap();
                assert_eq!(bits(be, &out), bits(be, &out1), "{what}");
                if p > 0.0 {
                    let dropped = be.to_vec(&out).unwrap()[at..at + ec]
                        .iter()
                        .zip(&residual[4 - at..])
                        .filter(|(o, r)| o == r)
                        .count();
                    assert!(dropped > 0, "{what}: no element dropped");
                }
            }
        }
    }
}
