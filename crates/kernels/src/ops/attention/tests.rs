use super::*;
use crate::testing::{Arg, SeedRng, assert_nmse, check_twin, cpu_backend};

fn shape() -> AttnShape {
    AttnShape {
        batch: 3,
        t: 7,
        heads: 2,
        head_dim: 5,
    }
}

#[test]
fn training_attention_matches_twin_with_and_without_dropout() {
    // Chunks of 210 floats: one sequence of QKV (210) per buffer, two of probabilities (98 each).
    matches_twin(shape(), Some(4 * 210));
}

/// Sequences longer than the CPU backend's block of query rows (64), the last block partial: every
/// row block and key block of the causal blocked form, against the GPU kernels and against finite
/// differences.
#[test]
fn training_attention_in_several_row_blocks_matches_twin_and_finite_differences() {
    matches_twin(
        AttnShape {
            batch: 2,
            t: 150,
            heads: 2,
            head_dim: 4,
        },
        None,
    );
    matches_finite_differences(AttnShape {
        batch: 1,
        t: 131,
        heads: 2,
        head_dim: 2,
    });
}

fn matches_twin(s: AttnShape, chunk: Option<u64>) {
    let (c, n) = (s.heads * s.head_dim, s.batch * s.t);
    let mut rng = SeedRng::new(90);
    let qkv = rng.vec(n * 3 * c, -1.0, 1.0);
    let dy = rng.vec(n * c, -1.0, 1.0);
    for drop in [None, Some((0.25f32, 99u32))] {
        let args = [
            Arg::data(qkv.clone(), s.t * 3 * c),
            Arg::out(n * c, s.t * c),
            Arg::out(s.probs_len(), s.heads * s.t * s.t),
            Arg::out(s.probs_len(), s.heads * s.t * s.t),
            Arg::data(dy.clone(), s.t * c),
            Arg::out(n * 3 * c, s.t * 3 * c),
            Arg::out(s.probs_len(), s.heads * s.t * s.t),
        ];
        check_twin("attention", 1e-10, &args, chunk, |be, t| {
            let [tq, ty, tp, td, tdy, tdq, tsc] = t else {
                unreachable!()
            };
            let dropped = if drop.is_some() {
                Some(TMut::from(&mut *td))
            } else {
                None
            };
            attention_forward(
                be,
                PathSet::F32,
                (&*tq).into(),
                ty.into(),
                (&mut *tp).into(),
                dropped,
                false,
                s,
                drop,
            )?;
            if drop.is_none() {
                crate::ops::fill::fill(be, td.into(), s.probs_len(), 0.0)?;
            }
            let dropped = if drop.is_some() {
                Some(TRef::from(&*td))
            } else {
                None
            };
            attention_backward(
                be,
                PathSet::F32,
                (&*tq).into(),
                (&*tp).into(),
                dropped,
                (&*tdy).into(),
                tdq.into(),
                (&mut *tsc).into(),
                None,
                s,
                drop,
            )?;
            // What the scratch holds afterwards is not part of the contract (the CPU backend skips
            // the masked half that the GPU kernels compute there).
            crate::ops::fill::fill(be, tsc.into(), s.probs_len(), 0.0)
        });
    }
}

fn forward_cpu(qkv: &[f32], s: AttnShape) -> Vec<f32> {
    let be = cpu_backend();
    let c = s.heads * s.head_dim;
    let tq = be.from_f32(qkv, 1).unwrap();
    let mut ty = be.zeros(s.batch * s.t * c, 1).unwrap();
    let mut tp = be.zeros(s.probs_len(), 1).unwrap();
    attention_forward(
        &be,
        PathSet::F32,
        (&tq).into(),
        (&mut ty).into(),
        (&mut tp).into(),
        None,
        false,
        s,
        None,
    )
    .unwrap();
    be.to_vec(&ty).unwrap()
}

#[test]
fn training_attention_backward_matches_finite_differences() {
    matches_finite_differences(AttnShape {
        batch: 2,
        t: 4,
        heads: 2,
        head_dim: 3,
    });
}

fn matches_finite_differences(s: AttnShape) {
    let (c, n) = (s.heads * s.head_dim, s.batch * s.t);
    let mut rng = SeedRng::new(91);
    let qkv = rng.vec(n * 3 * c, -1.0, 1.0);
    let r = rng.vec(n * c, -1.0, 1.0);
    let be = cpu_backend();
    let tq = be.from_f32(&qkv, 1).unwrap();
    let mut ty = be.zeros(n * c, 1).unwrap();
    let mut tp = be.zeros(s.probs_len(), 1).unwrap();
    attention_forward(
        &be,
        PathSet::F32,
        (&tq).into(),
        (&mut ty).into(),
        (&mut tp).into(),
        None,
        false,
        s,
        None,
    )
    .unwrap();
    let tr = be.from_f32(&r, 1).unwrap();
    let mut tdq = be.zeros(n * 3 * c, 1).unwrap();
    let mut tsc = be.zeros(s.probs_len(), 1).unwrap();
    attention_backward(
        &be,
        PathSet::F32,
        (&tq).into(),
        (&tp).into(),
        None,
        (&tr).into(),
        (&mut tdq).into(),
        (&mut tsc).into(),
        None,
        s,
        None,
    )
    .unwrap();
    let g = be.to_vec(&tdq).unwrap();
    let f = |x: &[f32]| {
        forward_cpu(x, s)
            .iter()
            .zip(&r)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum::<f64>()
    };
    for i in 0..qkv.len() {
        let (mut p, mut m) = (qkv.clone(), qkv.clone());
        p[i] += 1e-2;
        m[i] -= 1e-2;
        let fd = (f(&p) - f(&m)) / 2e-2;
        assert!(
            (fd - g[i] as f64).abs() < 2e-3,
            "dqkv[{i}]: fd {fd} vs {}",
            g[i]
        );
    }
}

#[test]
fn kv_cache_attention_matches_training_attention() {
    // The same heads through the cache kernel (one query row at a time, as decoding does, and all rows
    // at once, as prefill does) give the training path's output.
    let s = AttnShape {
        batch: 1,
        t: 9,
        heads: 3,
        head_dim: 8,
    };
    let c = s.heads * s.head_dim;
    let mut rng = SeedRng::new(92);
    let qkv = rng.vec(s.t * 3 * c, -1.0, 1.0);
    let want = forward_cpu(&qkv, s);
    let mut backends = vec![cpu_backend()];
    backends.extend(crate::testing::gpu_backend(None));
    for be in &backends {
        let tq = be.from_f32(&qkv, 1).unwrap();
        let d = |rows: usize, q_pos0: usize| DecodeShape {
            rows,
            heads: s.heads,
            kv_heads: s.heads,
            head_dim: s.head_dim,
            ld_q: 3 * c,
            ld_kv: 3 * c,
            ld_o: c,
            q_pos0,
            kv_len: s.t,
            window: 0,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            softcap: 0.0,
        };
        let mut out = crate::testing::poisoned(be, s.t * c, 1).unwrap();
        attend(
            be,
            tq.at(0),
            tq.at(c),
            tq.at(2 * c),
            (&mut out).into(),
            d(s.t, 0),
        )
        .unwrap();
        assert_nmse(
            &format!("{} prefill", be.kind()),
            &want,
            &be.to_vec(&out).unwrap(),
            1e-10,
        );
        let mut out = crate::testing::poisoned(be, s.t * c, 1).unwrap();
        for p in 0..s.t {
            attend(
                be,
                tq.at(p * 3 * c),
                tq.at(c),
                tq.at(2 * c),
                out.at_mut(p * c),
                d(1, p),
            )
            .unwrap();
        }
        assert_nmse(
            &format!("{} decode", be.kind()),
            &want,
            &be.to_vec(&out).unwrap(),
            1e-10,
        );
    }
}

#[test]
fn grouped_query_sliding_window_softcap_decode_matches_twin() {
    let mut rng = SeedRng::new(93);
    let (rows, heads, kv_heads, hd, cap) = (5, 6, 2, 16, 40);
    let s = DecodeShape {
        rows,
        heads,
        kv_heads,
        head_dim: hd,
        ld_q: heads * hd,
        ld_kv: kv_heads * hd,
        ld_o: heads * hd + 3,
        q_pos0: 20,
        kv_len: 25,
        window: 7,
        scale: 0.3,
        softcap: 2.0,
    };
    let args = [
        Arg::data(rng.vec(rows * heads * hd, -2.0, 2.0), 1),
        Arg::data(rng.vec(cap * kv_heads * hd, -2.0, 2.0), 1),
        Arg::data(rng.vec(cap * kv_heads * hd, -2.0, 2.0), 1),
        Arg::data(vec![0.5; rows * (heads * hd + 3)], 1),
    ];
    let out = check_twin("attend", 1e-10, &args, None, |be, t| {
        let [tq, tk, tv, to] = t else { unreachable!() };
        attend(
            be,
            (&*tq).into(),
            (&*tk).into(),
            (&*tv).into(),
            to.into(),
            s,
        )
    });
    // Padding between output rows is untouched.
    assert_eq!(out[3][heads * hd], 0.5);
}

/// Prompt rows through the tiled kernel: several blocks of 16 query rows and a partial one, head sizes
/// of one chunk, of a partial chunk and of four chunks, grouped heads, a later chunk of a prompt
/// (q_pos0 > 0) with a window that starts inside a block of keys, a soft cap, and keys split across
/// workgroups (then merged) for long prompts.
#[test]
fn prompt_attention_in_tiles_matches_twin() {
    let mut rng = SeedRng::new(94);
    // (rows, heads, kv_heads, head_dim, q_pos0, window, softcap)
    for (rows, heads, kv_heads, hd, q_pos0, window, softcap) in [
        (37, 3, 1, 64, 0, 0, 0.0),
        (50, 2, 2, 80, 13, 0, 0.0),
        (33, 4, 1, 256, 40, 21, 0.0),
        (16, 6, 3, 40, 5, 0, 3.0),
        // Long enough for the keys to be split across workgroups and merged.
        (150, 2, 1, 64, 0, 0, 0.0),
        (40, 4, 1, 256, 300, 0, 0.0),
        (200, 3, 3, 32, 100, 150, 0.0),
    ] {
        let kv_len = q_pos0 + rows;
        let s = DecodeShape {
            rows,
            heads,
            kv_heads,
            head_dim: hd,
            ld_q: heads * hd + 4,
            ld_kv: 2 * kv_heads * hd,
            ld_o: heads * hd,
            q_pos0,
            kv_len,
            window,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap,
        };
        let args = [
            Arg::data(rng.vec(rows * s.ld_q, -2.0, 2.0), 1),
            Arg::data(rng.vec(kv_len * s.ld_kv, -2.0, 2.0), 1),
            Arg::out(rows * s.ld_o, 1),
        ];
        check_twin("attend (tiles)", 1e-10, &args, None, |be, t| {
            let [tq, tkv, to] = t else { unreachable!() };
            attend(
                be,
                (&*tq).into(),
                tkv.at(0),
                tkv.at(kv_heads * hd),
                to.into(),
                s,
            )
        });
    }
}

/// Decode rows of several sequences sharing one cache tensor, against each row through the CPU
/// attention: grouped heads in one and two workgroups per KV head, head sizes 64/128/256, contexts of one
/// split and of several (merged by the second kernel), a sliding window, a soft cap, and the cache split
/// across buffers at whole sequences.
#[test]
fn decode_rows_match_twin() {
    let mut rng = SeedRng::new(93);
    let ctx = 700;
    // The last case's cache rows are not 16-byte multiples: it runs row by row (the twin's way).
    // Rows: positions across splits and at the window's edge, two rows of one sequence; then shorter
    // contexts only.
    let long: Vec<[u32; 2]> = vec![
        [0, 5],
        [ctx as u32, 300],
        [2 * ctx as u32, 699],
        [0, 256],
        [ctx as u32, 0],
    ];
    let short: Vec<[u32; 2]> = vec![[0, 5], [ctx as u32, 255], [2 * ctx as u32, 100]];
    for (heads, kv_heads, hd, window, softcap, pad, host) in [
        (9usize, 3usize, 64usize, 0usize, 0.0f32, 4usize, &long),
        (4, 1, 256, 512, 0.0, 4, &long),
        (8, 2, 128, 0, 30.0, 0, &long),
        (14, 2, 64, 0, 0.0, 8, &long),
        (2, 1, 64, 0, 0.0, 3, &long),
        (9, 3, 64, 0, 0.0, 4, &short),
        (4, 1, 256, 0, 0.0, 4, &short),
        (14, 2, 64, 0, 30.0, 8, &short),
    ] {
        let kvd = kv_heads * hd;
        let ld_kv = 2 * kvd + pad;
        let seqs = 3;
        let n = host.len();
        let (ld_q, ld_o) = (heads * hd + 1, heads * hd + 2);
        let q = rng.normal_vec(n * ld_q, 1.0);
        let cache = rng.normal_vec(seqs * ctx * ld_kv, 1.0);
        let words: Vec<u32> = host.iter().flatten().copied().collect();
        let args = [
            Arg::data(q, ld_q),
            Arg::data(cache, ctx * ld_kv),
            Arg::words(&words, 2),
            Arg::out(n * ld_o, ld_o),
        ];
        let s = RowsShape {
            heads,
            kv_heads,
            head_dim: hd,
            ld_q,
            ld_kv,
            ld_o,
            k_at: pad.min(4) / 4 * 4,
            v_at: kvd + pad / 4 * 4,
            window,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap,
        };
        let name = format!("attend_rows {heads}/{kv_heads}x{hd} window {window} cap {softcap}");
        let out = check_twin(
            &name,
            1e-10,
            &args,
            Some((ctx * ld_kv * 4) as u64),
            |be, t| {
                let [tq, tc, tt, to] = t else { unreachable!() };
                let rows = CacheRows {
                    table: tt.at(0),
                    host,
                };
                // Padding between output rows stays as it was: write it first.
                crate::ops::fill::fill(be, to.into(), n * ld_o, 0.5)?;
                attend_rows(be, tq.at(0), tc.at(0), rows, to.at_mut(0), s)
            },
        );
        for r in 0..n {
            assert_eq!(
                out[3][r * ld_o + heads * hd],
                0.5,
                "{name}: padding after row {r}"
            );
        }
        // All rows in one dispatch, plus one to merge the splits (a row is past one chunk).
        if let Some(g) = crate::testing::gpu_backend(None) {
            let t: Vec<_> = args
                .iter()
                .map(|a| {
                    g.from_f32(a.data.as_deref().unwrap_or(&vec![0.0; a.len]), a.unit)
                        .unwrap()
                })
                .collect();
            let mut o = g.zeros(n * ld_o, ld_o).unwrap();
            let gb = g.as_gpu().unwrap();
            gb.sync().unwrap();
            let before = gb.counters().dispatches;
            let rows = CacheRows {
                table: t[2].at(0),
                host,
            };
            attend_rows(&g, t[0].at(0), t[1].at(0), rows, o.at_mut(0), s).unwrap();
            // All rows in one dispatch and its merge; else row by row (each row's keys possibly
            // split and merged).
            let used = gb.counters().dispatches - before;
            let want = if pad % 4 == 0 {
                2..=2
            } else {
                n as u64..=2 * n as u64
            };
            assert!(want.contains(&used), "{name}: {used} dispatches");
        }
    }
}

/// The new rows' attention (norms, RoPE and the cache writes inside the attention's dispatch) against
/// its twin, rope_into_cache then attend_rows: the output and every cache row, written or not. SmolLM2's
/// heads (llama rotation), Gemma 3's (NeoX, Q/K norms, 256 dimensions, a window), seven query heads a KV
/// head (two workgroups share it; one writes), a partial rotation with norms, no rotation; rows of one
/// split and of several, the cache split across buffers. Rows of one sequence (a row would read another
/// row's new key) take the two ops on every backend. A row alone comes back as its splits, merged
/// by `merge_splits`.
#[test]
fn new_rows_match_twin() {
    use crate::ops::rope::{QkNorm, RopeCacheShape, RopeLayout, rope_table};
    let mut rng = SeedRng::new(95);
    let ctx = 700;
    let c = ctx as u32;
    let long: Vec<[u32; 2]> = vec![[0, 5], [c, 300], [2 * c, 699], [3 * c, 256], [4 * c, 0]];
    let short: Vec<[u32; 2]> = vec![[0, 31], [c, 32], [2 * c, 100]];
    let same_seq: Vec<[u32; 2]> = vec![[0, 5], [0, 256], [c, 40]];
    // One row: its splits merged by their own dispatch (10 splits of 258 floats per head), or left
    // for the output product (4 splits).
    let one: Vec<[u32; 2]> = vec![[c, 300]];
    let one_short: Vec<[u32; 2]> = vec![[c, 100]];
    use RopeLayout::{Neox, Normal};
    for (heads, kv_heads, hd, n_rot, layout, norm, window, host) in [
        (
            9usize, 3usize, 64usize, 64usize, Normal, false, 0usize, &long,
        ),
        (4, 1, 256, 256, Neox, true, 512, &long),
        (14, 2, 64, 64, Neox, false, 0, &short),
        (8, 2, 128, 64, Normal, true, 0, &short),
        (2, 1, 32, 0, Normal, true, 0, &short),
        (9, 3, 64, 64, Normal, false, 0, &same_seq),
        (4, 1, 256, 256, Neox, true, 0, &one),
        (4, 1, 256, 256, Neox, true, 0, &one_short),
    ] {
        let (qd, kvd) = (heads * hd, kv_heads * hd);
        let seqs = 5;
        let n = host.len();
        // Input rows [pad | q | k | v | pad], as a product's output with room around the slots.
        let ld_in = qd + 2 * kvd + 7;
        let ld_kv = 2 * kvd;
        let ld_o = qd + 2;
        let positions = ctx;
        let table = rope_table(n_rot.max(2), 10_000.0, 1.0, positions);
        let words: Vec<u32> = host.iter().flatten().copied().collect();
        let args = [
            Arg::data(rng.normal_vec(n * ld_in, 2.0), ld_in),
            Arg::data(rng.normal_vec(seqs * ctx * ld_kv, 1.0), ctx * ld_kv),
            Arg::words(&words, 2),
            Arg::data(table, 2),
            Arg::data(rng.vec(2 * hd, 0.5, 1.5), hd),
            // Padding between output rows stays as it was.
            Arg::data(vec![0.5; n * ld_o], ld_o),
        ];
        let rs = RopeCacheShape {
            heads,
            kv_heads,
            head_dim: hd,
            n_rot,
            layout,
            ld_in,
            q_at: 3,
            k_at: 3 + qd,
            v_at: 3 + qd + kvd,
            ld_q: qd,
            ld_kv,
        };
        let s = RowsShape {
            heads,
            kv_heads,
            head_dim: hd,
            ld_q: qd,
            ld_kv,
            ld_o,
            k_at: 0,
            v_at: kvd,
            window,
            scale: 1.0 / (hd as f32).sqrt(),
            softcap: 0.0,
        };
        let name = format!(
            "attend_new_rows {heads}/{kv_heads}x{hd} rot {n_rot} {layout:?} norm {norm} window {window} rows {host:?}"
        );
        let left = std::cell::Cell::new(false);
        let run = |be: &Backend, t: &mut [crate::Tensor]| -> crate::Result<()> {
            let [ti, tc, tt, tr, tw, to] = t else {
                unreachable!()
            };
            let rows = CacheRows {
                table: tt.at(0),
                host,
            };
            let new = NewRows {
                input: ti.at(0),
                table: tr.at(0),
                positions,
                norm: norm.then(|| QkNorm {
                    q: tw.at(0),
                    k: tw.at(hd),
                    eps: 1e-6,
                }),
                shape: rs,
            };
            let mut q = be.zeros(n * qd, qd)?;
            // A row left as splits is merged here, as the output product would.
            left.set(false);
            match attend_new_rows(
                be,
                new,
                q.at_mut(0),
                tc.at_mut(0),
                rows,
                to.at_mut(0),
                s,
                true,
            )? {
                Attended::Written => Ok(()),
                Attended::Splits { part, n_split } => {
                    assert!(n == 1, "{n} rows left as splits");
                    left.set(true);
                    merge_splits(be, part.at(0), to.at_mut(0), heads, hd, n_split)
                }
            }
        };
        check_twin(&name, 1e-10, &args, Some((ctx * ld_kv * 4) as u64), run);
        // One dispatch and the merge where the rows are different sequences; the two ops otherwise.
        if let Some(g) = crate::testing::gpu_backend(None) {
            let mut t: Vec<_> = args
                .iter()
                .map(|a| {
                    g.from_f32(a.data.as_deref().unwrap_or(&vec![0.0; a.len]), a.unit)
                        .unwrap()
                })
                .collect();
            let gb = g.as_gpu().unwrap();
            gb.sync().unwrap();
            let before = gb.counters().dispatches;
            run(&g, &mut t).unwrap();
            let used = gb.counters().dispatches - before;
            let splits = host
                .iter()
                .map(|r| r[1] as usize + 1)
                .max()
                .unwrap()
                .div_ceil(CHUNK);
            let fused = 1 + u64::from(splits > 1);
            let want = if std::ptr::eq(host, &same_seq) {
                fused + 1
            } else {
                fused
            };
            assert_eq!(used, want, "{name}: dispatches");
            // Only a short row's few splits wait for the product.
            assert_eq!(
                left.get(),
                std::ptr::eq(host, &one_short),
                "{name}: left as splits"
            );
        }
    }
}

/// A context of more splits than the merge kernel's workgroup holds at once (8,300 positions: 260 splits
/// of 32, merged 256 at a time), beside a short row in the same dispatch.
#[test]
fn decode_rows_merge_more_splits_than_a_workgroup() {
    let mut rng = SeedRng::new(94);
    let (ctx, heads, kv_heads, hd) = (8300usize, 2usize, 1usize, 64usize);
    let host: Vec<[u32; 2]> = vec![[0, 8299], [0, 40], [0, 8191]];
    let kvd = kv_heads * hd;
    let ld_kv = 2 * kvd;
    let n = host.len();
    let (ld_q, ld_o) = (heads * hd, heads * hd);
    let words: Vec<u32> = host.iter().flatten().copied().collect();
    let args = [
        Arg::data(rng.normal_vec(n * ld_q, 1.0), ld_q),
        Arg::data(rng.normal_vec(ctx * ld_kv, 1.0), ld_kv),
        Arg::words(&words, 2),
        Arg::out(n * ld_o, ld_o),
    ];
    let s = RowsShape {
        heads,
        kv_heads,
        head_dim: hd,
        ld_q,
        ld_kv,
        ld_o,
        k_at: 0,
        v_at: kvd,
        window: 0,
        scale: 1.0 / (hd as f32).sqrt(),
        softcap: 0.0,
    };
    check_twin(
        "attend_rows over 260 splits",
        1e-10,
        &args,
        None,
        |be, t| {
            let [tq, tc, tt, to] = t else { unreachable!() };
            let rows = CacheRows {
                table: tt.at(0),
                host: &host,
            };
            attend_rows(be, tq.at(0), tc.at(0), rows, to.at_mut(0), s)
        },
    );
}

/// A row past the cache is refused, not read out of bounds.
#[test]
fn decode_rows_refuse_positions_past_the_cache() {
    let be = cpu_backend();
    let q = be.zeros(64, 64).unwrap();
    let cache = be.zeros(10 * 128, 128).unwrap();
    let table = be.from_u32(&[5, 5], 2).unwrap();
    let mut out = be.zeros(64, 64).unwrap();
    let s = RowsShape {
        heads: 1,
        kv_heads: 1,
        head_dim: 64,
        ld_q: 64,
        ld_kv: 128,
        ld_o: 64,
        k_at: 0,
        v_at: 64,
        window: 0,
        scale: 0.125,
        softcap: 0.0,
    };
    let rows = CacheRows {
        table: table.at(0),
        host: &[[5, 5]],
    };
    assert!(attend_rows(&be, q.at(0), cache.at(0), rows, out.at_mut(0), s).is_err());
}

/// Four keys at once give each key's `dot` bit for bit (the batched decode rows and a row alone both
/// rely on it), at head sizes with and without a tail past the 16-lane chunks.
#[test]
fn dot4_is_dot_four_times() {
    let mut rng = SeedRng::new(44);
    for len in [1, 7, 16, 64, 80, 128, 256, 131] {
        let a = rng.vec(len, -2.0, 2.0);
        let b: Vec<Vec<f32>> = (0..4).map(|_| rng.vec(len, -2.0, 2.0)).collect();
        let four = dot4(&a, [&b[0], &b[1], &b[2], &b[3]]);
        for (k, bk) in b.iter().enumerate() {
            assert_eq!(
                four[k].to_bits(),
                dot(&a, bk).to_bits(),
                "len {len} key {k}"
            );
        }
    }
}

/// The tensor-core training path's form (`pairs`): Q, K, V and dY given as f16 pairs, the
/// probabilities P·V and Pᵀ·dY read, and the scores' gradient dS·K and dSᵀ·Q read, as f16 pairs, and
/// y and dQ, dK, dV written as pairs. On
/// that path's products (which stage those same f16 values from f32) y and dqkv are the f32 form's
/// values packed, bit for bit, with and without dropout, on sequences of several workgroups of rows
/// and an odd length (the f32 form, then packed). The CPU backend refuses the form.
#[test]
fn f16_pairs_give_the_tensor_core_path_s_values() {
    use crate::DType;
    use crate::ops::matmul::packed_len;
    use crate::path::PathId;
    let paths = PathSet::of(&[PathId::MixedTraining]);
    let mut rng = SeedRng::new(93);
    for s in [
        // Heads of 16: the products take the tensor cores where the adapter has them.
        AttnShape {
            batch: 2,
            t: 40,
            heads: 3,
            head_dim: 16,
        },
        AttnShape {
            batch: 1,
            t: 33,
            heads: 2,
            head_dim: 4,
        },
    ] {
        let (c, n, np) = (s.heads * s.head_dim, s.batch * s.t, s.probs_len());
        let qkv = rng.vec(n * 3 * c, -1.0, 1.0);
        let dy = rng.vec(n * c, -1.0, 1.0);
        let run = |be: &Backend, pairs: bool, drop: AttnDropout| -> Result<(Vec<u32>, Vec<u32>)> {
            let out = |len: usize| match pairs {
                true => be.zeros_typed(packed_len(len), 1, DType::U32),
                false => be.zeros(len, 1),
            };
            // With pairs, Q, K, V and dY go in as the pairs their products stage.
            let input = |v: &[f32]| -> Result<crate::Tensor> {
                let t = be.from_f32(v, 1)?;
                if !pairs {
                    return Ok(t);
                }
                let mut p = out(v.len())?;
                crate::ops::matmul::pack_f16(be, t.at(0), p.at_mut(0), v.len())?;
                Ok(p)
            };
            let tq = input(&qkv)?;
            let tdy = input(&dy)?;
            let mut ty = out(n * c)?;
            let mut tp = be.zeros(np, 1)?;
            let mut td = match pairs {
                true => be.zeros_typed(packed_len(np), 1, DType::U32)?,
                false => be.zeros(np, 1)?,
            };
            let mut tdq = out(n * 3 * c)?;
            let mut tsc = be.zeros(np, 1)?;
            let mut tds = be.zeros_typed(packed_len(np), 1, DType::U32)?;
            let with_dropped = pairs || drop.is_some();
            attention_forward(
                be,
                paths,
                (&tq).into(),
                (&mut ty).into(),
                (&mut tp).into(),
                with_dropped.then(|| TMut::from(&mut td)),
                pairs,
                s,
                drop,
            )?;
            attention_backward(
                be,
                paths,
                (&tq).into(),
                (&tp).into(),
                with_dropped.then(|| TRef::from(&td)),
                (&tdy).into(),
                (&mut tdq).into(),
                (&mut tsc).into(),
                pairs.then(|| TMut::from(&mut tds)),
                s,
                drop,
            )?;
            // The pairs as words; the f32 form's values packed into pairs on the same backend.
            let words = |t: &crate::Tensor, len: usize| -> Result<Vec<u32>> {
                let packed;
                let t = match pairs {
                    true => t,
                    false => {
                        let mut p = be.zeros_typed(packed_len(len), 1, DType::U32)?;
                        crate::ops::matmul::pack_f16(be, t.at(0), p.at_mut(0), len)?;
                        packed = p;
                        &packed
                    }
                };
                Ok(be.to_vec(t)?.iter().map(|v| v.to_bits()).collect())
            };
            Ok((words(&ty, n * c)?, words(&tdq, n * 3 * c)?))
        };
        let cpu = cpu_backend();
        assert!(run(&cpu, true, None).is_err(), "the CPU backend's pairs");
        let Some(gpu) = crate::testing::gpu_backend(None) else {
            return;
        };
        for drop in [None, Some((0.25f32, 7u32))] {
            let (pairs, wide) = (
                run(&gpu, true, drop).unwrap(),
                run(&gpu, false, drop).unwrap(),
            );
            assert!(pairs.0 == wide.0, "t {} drop {drop:?}: y differs", s.t);
            assert!(pairs.1 == wide.1, "t {} drop {drop:?}: dqkv differs", s.t);
        }
    }
}
