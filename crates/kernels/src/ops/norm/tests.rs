use super::*;
use crate::ops::Grad;
use crate::ops::matmul::{pack_f16, packed_len};
use crate::testing::{Arg, SeedRng, check_twin, cpu_backend};

/// A forward case on `be`: x (normal, offset from zero) and w of `rows` x `cols`, and its shape.
fn forward_case(
    be: &Backend,
    rng: &mut SeedRng,
    rows: usize,
    cols: usize,
) -> (crate::Tensor, crate::Tensor, NormShape) {
    let x: Vec<f32> = rng
        .normal_vec(rows * cols, 2.0)
        .iter()
        .map(|v| v + 0.7)
        .collect();
    let w = rng.vec(cols, 0.5, 1.5);
    let s = NormShape {
        rows,
        cols,
        eps: 1e-5,
    };
    let (tx, tw) = (
        be.from_f32(&x, cols).unwrap(),
        be.from_f32(&w, cols).unwrap(),
    );
    (tx, tw, s)
}

fn run_both(kind: NormKind, rows: usize, cols: usize, split: Option<u64>, seed: u64) {
    let mut rng = SeedRng::new(seed);
    let x: Vec<f32> = rng
        .vec(rows * cols, -2.0, 2.0)
        .iter()
        .map(|v| v + 0.5)
        .collect();
    let w = rng.vec(cols, 0.5, 1.5);
    let dy = rng.vec(rows * cols, -1.0, 1.0);
    let dx0 = rng.vec(rows * cols, -1.0, 1.0);
    let dw0 = rng.vec(cols, -1.0, 1.0);
    let s = NormShape {
        rows,
        cols,
        eps: 1e-5,
    };
    let args = [
        Arg::data(x, cols),
        Arg::data(w, cols),
        Arg::out(rows * cols, cols),
        Arg::out(2 * rows, 1),
        Arg::data(dy, cols),
        Arg::out(rows * cols, cols),
        Arg::out(cols, cols),
        Arg::data(dx0, cols),
        Arg::data(dw0, cols),
    ];
    check_twin(
        &format!("{kind:?} norm {rows}x{cols}"),
        1e-10,
        &args,
        split,
        |be, t| {
            let [tx, tw, ty, ts, tdy, tdx, tdw, tdx2, tdw2] = t else {
                unreachable!()
            };
            norm_forward(
                be,
                kind,
                (&*tx).into(),
                (&*tw).into(),
                ty.into(),
                (&mut *ts).into(),
                s,
            )?;
            norm_backward(
                be,
                kind,
                (&*tx).into(),
                (&*tw).into(),
                (&*tdy).into(),
                (&*ts).into(),
                tdx.into(),
                tdw.into(),
                s,
                Grad::Overwrite,
                Grad::Overwrite,
            )?;
            norm_backward(
                be,
                kind,
                (&*tx).into(),
                (&*tw).into(),
                (&*tdy).into(),
                (&*ts).into(),
                tdx2.into(),
                tdw2.into(),
                s,
                Grad::Accumulate,
                Grad::Accumulate,
            )
        },
    );
}

#[test]
fn norms_match_their_twins_at_odd_sizes() {
    for kind in [NormKind::Layer, NormKind::Rms] {
        // (A 1-wide LayerNorm's input gradient is identically zero, where NMSE is undefined, and a 2-wide
        // one is zero but for eps's share, ~1e-6 of rounding noise that an H100's fused multiply-adds
        // round differently: the smallest case is 3 wide.)
        run_both(kind, 1, 3, None, 1);
        run_both(kind, 7, 384, None, 2);
        run_both(kind, 130, 65, Some(4096), 3);
        run_both(kind, 3, 1000, Some(8192), 4);
        // The backward pass's blocks of 16 rows (one workgroup each, its weight-gradient partial sums
        // in one column of the scratch): several per binding, a partial last one, and bindings that
        // end inside a block.
        run_both(kind, 700, 70, None, 5);
        run_both(kind, 700, 70, Some(70 * 4 * 300), 6);
        // Many blocks (188): each thread of the final sum adds several of a column's partial sums.
        run_both(kind, 3000, 40, None, 7);
    }
}

/// Loss L = Σ y ⊙ r for a fixed random r: its gradient is norm_backward with dy = r.
fn loss(kind: NormKind, x: &[f32], w: &[f32], r: &[f32], s: NormShape) -> f64 {
    let be = cpu_backend();
    let (tx, tw) = (be.from_f32(x, 1).unwrap(), be.from_f32(w, 1).unwrap());
    let mut ty = be.zeros(x.len(), 1).unwrap();
    let mut ts = be.zeros(2 * s.rows, 1).unwrap();
    norm_forward(
        &be,
        kind,
        (&tx).into(),
        (&tw).into(),
        (&mut ty).into(),
        (&mut ts).into(),
        s,
    )
    .unwrap();
    be.to_vec(&ty)
        .unwrap()
        .iter()
        .zip(r)
        .map(|(a, b)| *a as f64 * *b as f64)
        .sum()
}

#[test]
fn norm_backward_matches_finite_differences() {
    for kind in [NormKind::Layer, NormKind::Rms] {
        let (rows, cols) = (3, 9);
        let s = NormShape {
            rows,
            cols,
            eps: 1e-5,
        };
        let mut rng = SeedRng::new(5);
        let x = rng.vec(rows * cols, -1.0, 1.0);
        let w = rng.vec(cols, 0.5, 1.5);
        let r = rng.vec(rows * cols, -1.0, 1.0);
        let be = cpu_backend();
        let (tx, tw, tr) = (
            be.from_f32(&x, 1).unwrap(),
            be.from_f32(&w, 1).unwrap(),
            be.from_f32(&r, 1).unwrap(),
        );
        let mut ty = be.zeros(rows * cols, 1).unwrap();
        let mut ts = be.zeros(2 * rows, 1).unwrap();
        let mut tdx = be.zeros(rows * cols, 1).unwrap();
        let mut tdw = be.zeros(cols, 1).unwrap();
        norm_forward(
            &be,
            kind,
            (&tx).into(),
            (&tw).into(),
            (&mut ty).into(),
            (&mut ts).into(),
            s,
        )
        .unwrap();
        norm_backward(
            &be,
            kind,
            (&tx).into(),
            (&tw).into(),
            (&tr).into(),
            (&ts).into(),
            (&mut tdx).into(),
            (&mut tdw).into(),
            s,
            Grad::Overwrite,
            Grad::Overwrite,
        )
        .unwrap();
        let (dx, dw) = (be.to_vec(&tdx).unwrap(), be.to_vec(&tdw).unwrap());
        let h = 1e-2f32;
        for i in 0..x.len() {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += h;
            xm[i] -= h;
            let fd = (loss(kind, &xp, &w, &r, s) - loss(kind, &xm, &w, &r, s)) / (2.0 * h as f64);
            assert!(
                (fd - dx[i] as f64).abs() < 2e-3 * (1.0 + fd.abs()),
                "{kind:?} dx[{i}]: fd {fd} vs {}",
                dx[i]
            );
        }
        for i in 0..cols {
            let (mut wp, mut wm) = (w.clone(), w.clone());
            wp[i] += h;
            wm[i] -= h;
            let fd = (loss(kind, &x, &wp, &r, s) - loss(kind, &x, &wm, &r, s)) / (2.0 * h as f64);
            assert!(
                (fd - dw[i] as f64).abs() < 2e-3 * (1.0 + fd.abs()),
                "{kind:?} dw[{i}]: fd {fd} vs {}",
                dw[i]
            );
        }
    }
}

/// x += RMSNorm(d) · w: against the twin, and on the GPU against the norm kernel followed by
/// add_assign — bit for bit where the two are compiled alike (a software adapter, CI's); an H100 gave
/// last-bit differences (most likely a multiply and the add fused into one multiply-add in one kernel
/// only), so on a GPU within NMSE 1e-13.
#[test]
fn add_rms_norm_matches_norm_then_add() {
    let mut rng = SeedRng::new(55);
    for (rows, cols) in [(1usize, 640usize), (3, 576), (2, 1000)] {
        let args = [
            Arg::data(rng.normal_vec(rows * cols, 1.0), cols),
            Arg::data(rng.normal_vec(rows * cols, 3.0), cols),
            Arg::data(rng.vec(cols, 0.5, 1.5), cols),
        ];
        let s = NormShape {
            rows,
            cols,
            eps: 1e-6,
        };
        check_twin(
            "add_rms_norm",
            1e-12,
            &args,
            Some((cols * 4) as u64),
            |be, t| {
                let [x, d, w] = t else { unreachable!() };
                add_rms_norm(be, x.at_mut(0), d.at(0), w.at(0), s)
            },
        );
        let Some(g) = crate::testing::gpu_backend(None) else {
            continue;
        };
        let mut got = Vec::new();
        for fused in [true, false] {
            let t: Vec<_> = args
                .iter()
                .map(|a| g.from_f32(a.data.as_ref().unwrap(), a.unit).unwrap())
                .collect();
            let [mut x, d, w] = <[_; 3]>::try_from(t).ok().unwrap();
            if fused {
                add_rms_norm(&g, x.at_mut(0), d.at(0), w.at(0), s).unwrap();
            } else {
                let mut y = g.zeros(rows * cols, cols).unwrap();
                let mut st = g.zeros(2 * rows, 1).unwrap();
                norm_forward(
                    &g,
                    NormKind::Rms,
                    d.at(0),
                    w.at(0),
                    y.at_mut(0),
                    st.at_mut(0),
                    s,
                )
                .unwrap();
                crate::ops::add::add_assign(&g, x.at_mut(0), y.at(0), rows * cols, 1.0).unwrap();
            }
            got.push(g.to_vec(&x).unwrap());
        }
        let what = format!("add_rms_norm {rows}x{cols}: against norm then add");
        if g.as_gpu().is_some_and(|gb| gb.is_software()) {
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert!(bits(&got[0]) == bits(&got[1]), "{what}: differs");
        } else {
            crate::testing::assert_nmse(&what, &got[1], &got[0], 1e-13);
        }
    }
}

/// The four-rows-a-workgroup forward kernel gives the one-row kernel's bits (the fused decode kernels
/// reproduce those), at row lengths below, at and past its 64 threads a row and 256 columns a pass,
/// row counts that leave a workgroup part-empty, and rows split across bindings.
#[test]
fn four_rows_a_workgroup_keep_the_bits() {
    let mut rng = SeedRng::new(61);
    for max_binding in [None, Some(4096u64)] {
        let Some(be) = crate::testing::gpu_backend(max_binding) else {
            return;
        };
        let Some(g) = be.as_gpu() else { return };
        for kind in [NormKind::Layer, NormKind::Rms] {
            for (rows, cols) in [
                (4usize, 1usize),
                (5, 37),
                (9, 64),
                (7, 200),
                (13, 384),
                (6, 576),
                (4, 1000),
            ] {
                let (tx, tw, s) = forward_case(&be, &mut rng, rows, cols);
                let run = |four: bool| {
                    let mut y = crate::testing::poisoned(&be, rows * cols, cols).unwrap();
                    let mut st = crate::testing::poisoned(&be, 2 * rows, 1).unwrap();
                    gpu_forward(
                        g,
                        kind,
                        tx.at(0),
                        tw.at(0),
                        y.at_mut(0),
                        st.at_mut(0),
                        s,
                        four,
                        Out::F32,
                    )
                    .unwrap();
                    (be.to_vec(&y).unwrap(), be.to_vec(&st).unwrap())
                };
                let (one, four) = (run(false), run(true));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                let what = format!("{kind:?} {rows}x{cols} binding {max_binding:?}");
                assert_eq!(bits(&one.0), bits(&four.0), "{what}: outputs");
                assert_eq!(bits(&one.1), bits(&four.1), "{what}: statistics");
            }
        }
    }
}

/// The f16-pairs forward writes the f32 forward's values rounded as `pack_f16` rounds them, and the
/// same statistics, bit for bit: on the CPU twin, on the GPU's one-row and four-row kernels writing
/// pairs (even rows, in one binding at a word offset that leaves the words before it alone, or split
/// across bindings), and through the fallback for odd rows (the f32 values, then packed).
#[test]
fn f16_pairs_hold_the_f32_values_rounded() {
    let mut rng = SeedRng::new(62);
    let mut backends = vec![(cpu_backend(), None)];
    for max_binding in [None, Some(4096u64)] {
        backends.extend(crate::testing::gpu_backend(max_binding).map(|b| (b, max_binding)));
    }
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    for (be, max_binding) in &backends {
        let split = max_binding.is_some();
        for kind in [NormKind::Layer, NormKind::Rms] {
            for (rows, cols) in [(5usize, 37usize), (9, 64), (13, 384), (1030, 384), (6, 576)] {
                if split && cols % 2 == 1 {
                    continue;
                }
                let n = rows * cols;
                let (tx, tw, s) = forward_case(be, &mut rng, rows, cols);
                let mut wide = be.zeros(n, cols).unwrap();
                let mut st = be.zeros(2 * rows, 1).unwrap();
                norm_forward(
                    be,
                    kind,
                    tx.at(0),
                    tw.at(0),
                    wide.at_mut(0),
                    st.at_mut(0),
                    s,
                )
                .unwrap();
                let wide = be.to_vec(&wide).unwrap();
                let cpu = cpu_backend();
                let mut want = cpu
                    .zeros_typed(packed_len(n), 1, crate::DType::U32)
                    .unwrap();
                let tw16 = cpu.from_f32(&wide, 1).unwrap();
                pack_f16(&cpu, tw16.at(0), want.at_mut(0), n).unwrap();
                let (want, want_st) = (bits(cpu.to_vec(&want).unwrap()), be.to_vec(&st).unwrap());
                let what = format!(
                    "{} {kind:?} {rows}x{cols} binding {max_binding:?}",
                    be.kind()
                );
                let mut forms = vec![None];
                if be.as_gpu().is_some() && cols % 2 == 0 {
                    forms.extend([Some(false), Some(true)]);
                }
                // Split bindings: y in rows of cols / 2 words from word 0.
                let (lead, unit) = if split { (0, cols / 2) } else { (2, 1) };
                for four in forms {
                    let len = lead + packed_len(n);
                    let mut y = be.zeros_typed(len, unit, crate::DType::U32).unwrap();
                    let mut st = crate::testing::poisoned(be, 2 * rows, 1).unwrap();
                    let (ty, ts) = (y.at_mut(lead), st.at_mut(0));
                    match (four, be.as_gpu()) {
                        (Some(four), Some(g)) => {
                            gpu_forward(g, kind, tx.at(0), tw.at(0), ty, ts, s, four, Out::F16)
                        }
                        _ => norm_forward_f16(be, kind, tx.at(0), tw.at(0), ty, ts, s),
                    }
                    .unwrap();
                    let got = bits(be.to_vec(&y).unwrap());
                    assert_eq!(
                        &got[..lead],
                        &vec![0; lead][..],
                        "{what} {four:?}: before y"
                    );
                    assert_eq!(&got[lead..], &want[..], "{what} {four:?}: outputs");
                    let st = bits(be.to_vec(&st).unwrap());
                    assert_eq!(st, bits(want_st.clone()), "{what} {four:?}: statistics");
                }
            }
        }
    }
}
