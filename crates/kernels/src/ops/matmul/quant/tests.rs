//! The quantized kernels against their twins: the GPU kernels against the CPU backend (itself checked
//! against f64 math on the dequantized weights), whole and with every tensor split across small buffers;
//! and one weight matrix above the real 128 MiB binding limit.
//!
//! NMSE bounds: both sides compute f32 sums of the same exact products (integer quant × f32 activation,
//! times the block's scale), only grouped differently, so each output differs by a few f32 roundings of
//! its partial sums: |err| ≲ √K · 2⁻²⁴ · Σ|terms|, and with random signs the NMSE (a mean of squares,
//! where rounding errors add randomly) is of order (√K · 6e-8)², below 1.5e-11 even at K = 4096.
//! Measured on lavapipe: GPU vs CPU at most 1.3e-13 for K ≤ 4096 (2.3e-13 at K = 16384), CPU vs f64 at
//! most 1.2e-13. The bound, 1e-11, leaves ~80x of margin over that and still catches one wrong block (a
//! single wrong scale or quant moves the NMSE by far more than 1e-6).

use super::*;
use crate::ops::matmul::fused::{Input, Output, matmul_fused};
use crate::ops::matmul::{Gemm, RowMode, matmul};
use crate::rng::SeedRng;
use crate::testing::{Arg, assert_nmse, check_twin, cpu_backend};

/// The path set these tests run with: the quantized kernels on.
fn q() -> PathSet {
    PathSet::of(&[PathId::QuantMatmul])
}

/// y[m, N] = x[m, K] · Wᵀ through the one matmul entry point.
fn qmatmul(be: &Backend, x: TRef<'_>, w: &QMatrix, y: TMut<'_>, m: usize) -> Result<()> {
    matmul(be, q(), x, w, y, &Gemm::nt(m, w.rows(), w.cols()))
}

/// GPU vs CPU backend (f32 vs f32, only summation order differs; see the module docs).
const BOUND: f64 = 1e-11;
/// CPU backend vs f64 math on the dequantized weights.
const REF_BOUND: f64 = 1e-11;
/// Tensor chunks in the split runs: one 4096-wide row of x is 16 KiB, so every component's row fits.
const SPLIT: u64 = 32 << 10;

/// Block scales from across the range a GGUF file holds: mostly ordinary (either sign), some tiny
/// (f16 subnormal-sized), some large.
fn scale(rng: &mut SeedRng) -> f32 {
    let u = rng.range(0.05, 1.0) * if rng.below(2) == 0 { 1.0 } else { -1.0 };
    match rng.below(10) {
        0 => u * 1e-7,
        1 => u * 300.0,
        _ => u * 0.02,
    }
}

/// Random quants: every word uniform, so all 256 byte values (16 nibble values) occur; the first row
/// additionally counts through all of them in order.
fn words(rng: &mut SeedRng, n: usize, first_row: usize) -> Vec<u32> {
    let mut q: Vec<u32> = (0..n).map(|_| rng.next_u64() as u32).collect();
    for (i, w) in q.iter_mut().take(first_row).enumerate() {
        let b = (4 * i) as u32;
        *w = (b & 255) | ((b + 1) & 255) << 8 | ((b + 2) & 255) << 16 | ((b + 3) & 255) << 24;
    }
    q
}

fn q8(rng: &mut SeedRng, rows: usize, cols: usize, block: usize) -> Q8Matrix {
    Q8Matrix {
        rows,
        cols,
        block,
        scales: (0..rows * cols / block).map(|_| scale(rng)).collect(),
        quants: words(rng, rows * cols / 4, cols / 4),
    }
}

fn q4(rng: &mut SeedRng, rows: usize, cols: usize) -> Q4Matrix {
    let nb = rows * cols / 32;
    Q4Matrix {
        rows,
        cols,
        scales: (0..nb).map(|_| scale(rng)).collect(),
        mins: (0..nb).map(|_| -8.0 * scale(rng)).collect(),
        quants: words(rng, rows * cols / 8, cols / 8),
    }
}

fn source(rng: &mut SeedRng, kind: QKind, rows: usize, cols: usize) -> QuantSource {
    match kind {
        QKind::Q8 { block } => q8(rng, rows, cols, block).into(),
        QKind::Q4 => q4(rng, rows, cols).into(),
    }
}

/// y = x · Wᵀ in f64 on the dequantized weights.
pub(super) fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|c| x[i * k + c] as f64 * w[j * k + c] as f64)
                .sum();
            y[i * n + j] = s as f32;
        }
    }
    y
}

struct Case {
    src: QuantSource,
    m: usize,
    x: Vec<f32>,
}

/// Every (N, K) with every m, x and y at one row's offset (x's first row and y's first row are guards
/// that must come back unchanged), on the CPU backend, the GPU, and the GPU with split tensors.
fn matmul_cases(kind: QKind, seed: u64) {
    const SHAPES: [(usize, usize); 8] = [
        (33, 32),
        (7, 64),
        (129, 576),
        (65, 640),
        (17, 1536),
        (257, 1536),
        (9, 2048),
        (5, 4096),
    ];
    // Up to 17 rows the gemv and tiled-rows kernels, from 32 the GEMM (one tile, partial tiles).
    const MS: [usize; 8] = [1, 2, 3, 7, 9, 17, 33, 70];
    let mut rng = SeedRng::new(seed);
    let mut cases = Vec::new();
    let mut args = Vec::new();
    for (n, k) in SHAPES {
        let src = source(&mut rng, kind, n, k);
        for m in MS {
            let x = rng.normal_vec((m + 1) * k, 1.0);
            let mut y = rng.vec((m + 1) * n, -1.0, 1.0);
            y[n..].fill(f32::NAN);
            args.push(Arg::data(x.clone(), k));
            args.push(Arg::data(y, n));
            cases.push(Case {
                src: src.clone(),
                m,
                x,
            });
        }
    }
    let name = format!("qmatmul {kind:?}");
    let out = check_twin(&name, BOUND, &args, Some(SPLIT), |be, t| {
        for (i, c) in cases.iter().enumerate() {
            let w = QMatrix::upload(be, c.src.clone(), q())?;
            let (xs, ys) = t.split_at_mut(2 * i + 1);
            qmatmul(be, xs[2 * i].at(w.cols()), &w, ys[0].at_mut(w.rows()), c.m)?;
        }
        Ok(())
    });
    for (i, c) in cases.iter().enumerate() {
        let (n, k, _) = c.src.dims();
        let want = reference(&c.x[k..], &c.src.dequantize(), c.m, n, k);
        let y = &out[2 * i + 1];
        assert_eq!(
            &y[..n],
            &args[2 * i + 1].data.as_ref().unwrap()[..n],
            "{name}: guard row"
        );
        assert_nmse(
            &format!("{name} cpu vs f64, m={} n={n} k={k}", c.m),
            &want,
            &y[n..],
            REF_BOUND,
        );
    }
}

#[test]
fn qmatmul_q8_block32_matches_twins() {
    matmul_cases(QKind::Q8 { block: 32 }, 1);
}

#[test]
fn qmatmul_q8_block16_matches_twins() {
    matmul_cases(QKind::Q8 { block: 16 }, 2);
}

#[test]
fn qmatmul_q4_matches_twins() {
    matmul_cases(QKind::Q4, 3);
}

/// x and y at offsets that are not 16-byte aligned (x then takes the four-load path) and not row
/// multiples; no split run, since a split tensor's chunks start at row multiples of its unit.
#[test]
fn qmatmul_views_at_unaligned_offsets() {
    let mut rng = SeedRng::new(4);
    let mut cases = Vec::new();
    let mut args = Vec::new();
    let (xo, yo) = (3, 5);
    for kind in [QKind::Q8 { block: 32 }, QKind::Q8 { block: 16 }, QKind::Q4] {
        for (n, k, m) in [(65, 640, 1), (31, 64, 3), (19, 576, 9)] {
            let src = source(&mut rng, kind, n, k);
            let x = rng.normal_vec(xo + m * k + 2, 1.0);
            let mut y = rng.vec(yo + m * n + 2, -1.0, 1.0);
            y[yo..yo + m * n].fill(f32::NAN);
            args.push(Arg::data(x.clone(), 1));
            args.push(Arg::data(y, 1));
            cases.push(Case { src, m, x });
        }
    }
    let out = check_twin("qmatmul at offsets", BOUND, &args, None, |be, t| {
        for (i, c) in cases.iter().enumerate() {
            let w = QMatrix::upload(be, c.src.clone(), q())?;
            let (xs, ys) = t.split_at_mut(2 * i + 1);
            qmatmul(be, xs[2 * i].at(xo), &w, ys[0].at_mut(yo), c.m)?;
        }
        Ok(())
    });
    for (i, c) in cases.iter().enumerate() {
        let (n, k, _) = c.src.dims();
        let want = reference(&c.x[xo..xo + c.m * k], &c.src.dequantize(), c.m, n, k);
        let (y, y0) = (&out[2 * i + 1], args[2 * i + 1].data.as_ref().unwrap());
        assert_nmse(
            "qmatmul at offsets, cpu vs f64",
            &want,
            &y[yo..yo + c.m * n],
            REF_BOUND,
        );
        assert_eq!(&y[..yo], &y0[..yo]);
        assert_eq!(&y[yo + c.m * n..], &y0[yo + c.m * n..]);
    }
}

/// Token lookups from each table kind, with the table split across buffers in the split run, repeated
/// ids, ids past the table (zero rows), an output view at an offset and Gemma's sqrt(dim) scale.
#[test]
fn qget_rows_matches_twins() {
    let mut rng = SeedRng::new(5);
    let (rows, k) = (301, 640);
    let mut ids: Vec<u32> = (0..21).map(|_| rng.below(rows) as u32).collect();
    ids.extend([0, rows as u32 - 1, rows as u32, u32::MAX, ids[2]]);
    let n = ids.len();
    let scale = (k as f32).sqrt();
    let kinds = [QKind::Q8 { block: 32 }, QKind::Q8 { block: 16 }, QKind::Q4];
    let srcs: Vec<QuantSource> = kinds
        .iter()
        .map(|&kd| source(&mut rng, kd, rows, k))
        .collect();
    let mut args = vec![Arg::words(&ids, 1)];
    for _ in &kinds {
        let mut o = vec![0.5; (n + 1) * k];
        o[k..].fill(f32::NAN);
        args.push(Arg::data(o, k));
    }
    let out = check_twin("qget_rows", 1e-14, &args, Some(SPLIT), |be, t| {
        let (ti, outs) = t.split_at_mut(1);
        for (src, o) in srcs.iter().zip(outs) {
            let w = QMatrix::upload(be, src.clone(), q())?;
            get_rows(be, ti[0].at(0), &w, o.at_mut(k), n, scale)?;
        }
        Ok(())
    });
    for (src, o) in srcs.iter().zip(&out[1..]) {
        let deq = src.dequantize();
        assert!(o[..k].iter().all(|&v| v == 0.5), "guard row");
        for (i, &id) in ids.iter().enumerate() {
            let got = &o[(i + 1) * k..(i + 2) * k];
            if id as usize >= rows {
                assert!(
                    got.iter().all(|&v| v == 0.0),
                    "id {id} past the table gives zeros"
                );
            } else {
                let want: Vec<f32> = deq[id as usize * k..][..k]
                    .iter()
                    .map(|v| v * scale)
                    .collect();
                assert_eq!(got, &want[..], "token {i} (id {id})");
            }
        }
    }
}

/// A batch of independent rows (a decode batch: 2 and 3 rows on the one-row kernel's lanes, 16, 17 and
/// 40 on the batch kernel, in both its forms: weights converted once per workgroup, and by each lane)
/// gives every row the bits of the one-row product, for every layout, row lengths that take 1-3 vectors
/// a lane and 8-64 lanes a row, batches that fill workgroups of rows and that do not, writing and
/// adding, whole and split across buffers.
#[test]
fn independent_rows_have_the_bits_of_one_row() {
    const SHAPES: [(usize, usize); 5] = [(33, 32), (129, 576), (65, 640), (17, 1536), (9, 2048)];
    let mut rng = SeedRng::new(9);
    for (once, split) in [
        (true, None),
        (true, Some(SPLIT)),
        (false, None),
        (false, Some(SPLIT)),
    ] {
        super::gpu::CONVERT_ONCE.with(|f| f.set(Some(once)));
        let Some(be) = crate::testing::gpu_backend(split) else {
            return;
        };
        for kind in [QKind::Q8 { block: 32 }, QKind::Q8 { block: 16 }, QKind::Q4] {
            for (n, k) in SHAPES {
                let w = QMatrix::upload(&be, source(&mut rng, kind, n, k), q()).expect("upload");
                for (m, add) in [(2, false), (3, true), (16, false), (17, true), (40, false)] {
                    let x = rng.normal_vec(m * k, 1.0);
                    let y0 = rng.vec(m * n, -1.0, 1.0);
                    let xt = be.from_f32(&x, k).unwrap();
                    let mut batch = be.from_f32(&y0, n).unwrap();
                    let mut alone = be.from_f32(&y0, n).unwrap();
                    let out = if add {
                        Output::Accumulate
                    } else {
                        Output::Store
                    };
                    let product = |x: TRef<'_>, y: TMut<'_>, m: usize| {
                        let mode = RowMode::Independent;
                        matmul_fused(&be, q(), mode, Input::Rows(x), &w, y, [m, n, k], out)
                    };
                    product(xt.at(0), batch.at_mut(0), m).expect("batch");
                    for i in 0..m {
                        product(xt.at(i * k), alone.at_mut(i * n), 1).expect("one row");
                    }
                    let (got, want) = (be.to_vec(&batch).unwrap(), be.to_vec(&alone).unwrap());
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{kind:?} {m} x {n} x {k} (adding: {add}, split: {split:?}, converting once: {once}): a batch's rows differ from the rows alone"
                    );
                }
            }
        }
    }
}

/// Gemma-3's token table as a Q8_0 matrix: 262144 x 640 is 160 MiB of quants, above the 128 MiB binding
/// limit of the low-end profile, so it is split across two buffers; m = 1 logits and lookups on both
/// sides of the split match the CPU twin.
#[test]
fn weight_above_the_binding_limit_is_split() {
    let Some(be) = crate::testing::gpu_backend_low_end() else {
        return;
    };
    let (n, k) = (262_144, 640);
    let g = be.as_gpu().expect("gpu backend");
    assert!(
        (n * k) as u64 > g.max_chunk_bytes(),
        "the test needs quants above one binding ({} bytes)",
        g.max_chunk_bytes()
    );
    let mut rng = SeedRng::new(6);
    let w = q8(&mut rng, n, k, 32);
    let x = rng.normal_vec(k, 1.0);
    let mut want = vec![0.0; n];
    cpu::q8_matmul_nt(&x, &w, &mut want, 1);
    // The first row of the second buffer of quants.
    let split = (g.max_chunk_bytes() as usize / 4) / (k / 4);
    let ids = [
        0,
        1,
        split as u32 - 1,
        split as u32,
        250_000,
        n as u32 - 1,
        n as u32,
    ];
    let looked: Vec<Vec<f32>> = ids
        .iter()
        .map(|&id| {
            let mut r = vec![0.0; k];
            if (id as usize) < n {
                w.dequantize_row(id as usize, &mut r);
                r.iter_mut().for_each(|v| *v *= 2.0);
            }
            r
        })
        .collect();

    let qm = QMatrix::upload(&be, w, q()).expect("upload");
    assert_eq!(qm.num_chunks(), 2, "quants split into two buffers");
    let xt = be.from_f32(&x, k).unwrap();
    let mut yt = crate::testing::poisoned(&be, n, n).unwrap();
    qmatmul(&be, xt.at(0), &qm, yt.at_mut(0), 1).expect("qmatmul");
    let it = be.from_u32(&ids, 1).unwrap();
    let mut ot = crate::testing::poisoned(&be, ids.len() * k, k).unwrap();
    get_rows(&be, it.at(0), &qm, ot.at_mut(0), ids.len(), 2.0).expect("qget_rows");
    let got = be.to_vec(&yt).unwrap();
    assert_nmse("262144 x 640 logits", &want, &got, BOUND);
    let near = |a: &[f32]| a[split - 3..split + 3].to_vec();
    assert_nmse("logits around the split", &near(&want), &near(&got), BOUND);
    let rows = be.to_vec(&ot).unwrap();
    for (i, r) in looked.iter().enumerate() {
        assert_eq!(&rows[i * k..(i + 1) * k], &r[..], "lookup of id {}", ids[i]);
    }
    let back = pollster::block_on(qm.dequantize_rows(&be, split - 1..split + 1)).unwrap();
    assert_eq!(
        back[..k].iter().map(|v| v * 2.0).collect::<Vec<_>>(),
        looked[2]
    );
}

#[test]
fn bad_shapes_are_refused() {
    let be = cpu_backend();
    let mut rng = SeedRng::new(7);
    let good = q8(&mut rng, 4, 64, 32);
    let mut short = good.clone();
    short.quants.pop();
    assert!(QMatrix::upload(&be, short, q()).is_err());
    let mut odd = good.clone();
    odd.block = 24;
    assert!(QMatrix::upload(&be, odd, q()).is_err());
    let mut ragged = q4(&mut rng, 4, 64);
    ragged.cols = 48;
    assert!(QMatrix::upload(&be, ragged, q()).is_err());
    let empty = Q8Matrix {
        rows: 0,
        cols: 32,
        block: 32,
        scales: vec![],
        quants: vec![],
    };
    assert!(QMatrix::upload(&be, empty, q()).is_err());

    let w = QMatrix::upload(&be, good, q()).unwrap();
    assert_eq!(w.bytes(), 4 * (4 * 64 / 32 + 4 * 64 / 4) as u64);
    let x = be.zeros(2 * 64, 64).unwrap();
    let mut y = be.zeros(2 * 4, 4).unwrap();
    assert!(qmatmul(&be, x.at(0), &w, y.at_mut(0), 2).is_ok());
    assert!(
        qmatmul(&be, x.at(1), &w, y.at_mut(0), 2).is_err(),
        "x too short"
    );
    assert!(
        qmatmul(&be, x.at(0), &w, y.at_mut(0), 3).is_err(),
        "m too large"
    );
    let ids = be.from_u32(&[1, 2], 1).unwrap();
    let mut out = be.zeros(2 * 64, 64).unwrap();
    assert!(get_rows(&be, ids.at(0), &w, out.at_mut(0), 2, 1.0).is_ok());
    assert!(
        get_rows(&be, ids.at(0), &w, out.at_mut(1), 2, 1.0).is_err(),
        "out too short"
    );
}

/// A prompt long enough for the GEMM's 64-row tiles (a short one takes 32-row tiles: the cases above),
/// in every block layout, against f64 math on the dequantized weights.
#[test]
fn qgemm_tall_tiles_match_reference() {
    let Some(be) = crate::testing::gpu_backend(None) else {
        return;
    };
    let mut rng = SeedRng::new(31);
    let (m, n, k) = (1000, 1100, 64);
    for kind in [QKind::Q8 { block: 32 }, QKind::Q8 { block: 16 }, QKind::Q4] {
        let src = source(&mut rng, kind, n, k);
        let x = rng.normal_vec(m * k, 1.0);
        let w = QMatrix::upload(&be, src.clone(), q()).unwrap();
        let tx = be.from_f32(&x, k).unwrap();
        let mut ty = be.zeros(m * n, n).unwrap();
        qmatmul(&be, (&tx).into(), &w, (&mut ty).into(), m).unwrap();
        let want = reference(&x, &src.dequantize(), m, n, k);
        assert_nmse(
            &format!("{kind:?}"),
            &want,
            &be.to_vec(&ty).unwrap(),
            REF_BOUND,
        );
    }
}

/// On the CPU backend with `int-dot`, a matrix is held repacked for the integer kernels: its token
/// lookups and dequantized rows are the source's bit for bit, and its products stay within the
/// activation rounding of the f32 kernels' (the gate's own bounds; `cpu_int`'s tests bound each output).
#[test]
fn cpu_int_dot_matrices_keep_their_source() {
    use crate::ops::matmul::quant::cpu_int::int_dot_available;
    let be = cpu_backend();
    let int = PathSet::of(&[PathId::IntDot]);
    let mut rng = SeedRng::new(9);
    let (rows, k, m) = (77, 320, 3);
    let ids: Vec<u32> = vec![0, 5, 76, 77, 40];
    let x = rng.vec(m * k, -1.0, 1.0);
    for kind in [QKind::Q8 { block: 32 }, QKind::Q8 { block: 16 }, QKind::Q4] {
        let src = source(&mut rng, kind, rows, k);
        let plain = QMatrix::upload(&be, src.clone(), PathSet::F32).unwrap();
        let packed = QMatrix::upload(&be, src.clone(), int).unwrap();
        // Where the CPU lacks the instructions the path is never gated on; the matrix keeps its source.
        assert_eq!(
            packed.bytes() == plain.bytes(),
            rows % 16 == 0 || !int_dot_available()
        );
        let look = |w: &QMatrix| {
            let it = be.from_u32(&ids, 1).unwrap();
            let mut o = be.zeros(ids.len() * k, k).unwrap();
            get_rows(&be, it.at(0), w, o.at_mut(0), ids.len(), 1.5).unwrap();
            be.to_vec(&o).unwrap()
        };
        assert_eq!(look(&plain), look(&packed), "{kind:?} lookups");
        let rows_of = |w: &QMatrix| pollster::block_on(w.dequantize_rows(&be, 3..70)).unwrap();
        assert_eq!(rows_of(&plain), rows_of(&packed), "{kind:?} rows");
        let prod = |w: &QMatrix, paths: PathSet| {
            let tx = be.from_f32(&x, k).unwrap();
            let mut ty = be.zeros(m * rows, rows).unwrap();
            matmul(&be, paths, tx.at(0), w, ty.at_mut(0), &Gemm::nt(m, rows, k)).unwrap();
            be.to_vec(&ty).unwrap()
        };
        let (a, b) = (prod(&plain, PathSet::F32), prod(&packed, int));
        assert_nmse(&format!("{kind:?} products"), &a, &b, 1e-7);
    }
}
