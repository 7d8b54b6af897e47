//! Causal multi-head attention.
//!
//! Training ([`attention_forward`], [`attention_backward`]) works straight out of the fused QKV tensor
//! `[batch, t, 3 · heads · head_dim]` with batched GEMMs over (sequence, head) pairs, a causal softmax
//! and dropout on the probabilities; the probabilities are kept for the backward pass.
//!
//! Inference ([`attend`]) runs query rows against a KV cache with grouped-query heads and an optional
//! sliding window, in one kernel.

mod causal_cpu;

use super::common::{PRELUDE, repeat_lines, row_kernel};
use super::dropout::check_probability;
use super::matmul::{Causal, Gemm, Weights, matmul, matmul_f16_a, matmul_f16_a_to_pairs};
use super::softmax::{
    SoftmaxShape, softmax_backward, softmax_dropout, softmax_dropout_backward,
    softmax_dropout_backward_f16, softmax_dropout_f16, softmax_planted,
};
use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, Operand, segments};
use crate::path::PathSet;
use rayon::prelude::*;

/// Shape of a training batch.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub batch: usize,
    pub t: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    fn c(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Elements of the probability tensor: batch · heads · t · t.
    pub fn probs_len(&self) -> usize {
        self.batch * self.heads * self.t * self.t
    }
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
    /// Scores/probabilities [b, h, i, j] (rows of t).
    fn p_stride(&self) -> [usize; 2] {
        [self.heads * self.t * self.t, self.t * self.t]
    }
    /// Q, K or V of (b, h) inside the fused QKV tensor.
    fn qkv_stride(&self) -> [usize; 2] {
        [self.t * 3 * self.c(), self.head_dim]
    }
    /// (b, h) inside a [b, t, c] tensor.
    fn y_stride(&self) -> [usize; 2] {
        [self.t * self.c(), self.head_dim]
    }
}

/// Dropout on the attention probabilities: (probability, seed).
pub type AttnDropout = Option<(f32, u32)>;

/// y = softmax(Q Kᵀ / √d, causal) V per (sequence, head). `probs` receives the probabilities and, with
/// dropout, `dropped` the dropped-out probabilities the product used (both `probs_len()` long). The
/// products run on the kernels `paths` chooses.
///
/// With `pairs` (the GPU's tensor-core training path, whose products stage their operands as f16),
/// `qkv` holds f16 pairs (`packed_len(rows · 3c)` words, c even: c_attn's product wrote them),
/// `dropped` receives the values the product reads — the dropped-out probabilities, or the
/// probabilities themselves without dropout — as f16 pairs (`packed_len(probs_len())` words), and
/// `y` is written as f16 pairs too: the values the products would stage from f32, in half the
/// bytes; [`attention_backward`] then takes them with its `ds_pairs`.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    be: &Backend,
    paths: PathSet,
    qkv: TRef<'_>,
    mut y: TMut<'_>,
    mut probs: TMut<'_>,
    dropped: Option<TMut<'_>>,
    pairs: bool,
    s: AttnShape,
    drop: AttnDropout,
) -> Result<()> {
    let (t, c, hd) = (s.t, s.c(), s.head_dim);
    const OP: &str = "attention_forward";
    if pairs && (dropped.is_none() || !matches!(be, Backend::Gpu(_)) || c % 2 != 0) {
        return Err(Error::Shape {
            op: OP,
            msg: "f16 pairs of the probabilities need a GPU, a tensor to hold them and an even \
                  width of the heads"
                .into(),
        });
    }
    if matches!((drop, &dropped), (Some((p, _)), None) if p > 0.0) {
        return Err(Error::Shape {
            op: OP,
            msg: "dropout needs a tensor for the dropped-out probabilities".into(),
        });
    }
    if let Backend::Cpu(cpu) = be {
        if let Some((p, _)) = drop {
            check_probability(OP, p)?;
        }
        let rows = s.batch * t;
        let qs = qkv.cpu(OP, "qkv", rows * 3 * c)?;
        let ys = y.cpu(OP, "y", rows * c)?;
        let ps = probs.cpu(OP, "probs", s.probs_len())?;
        let mut dropped = dropped;
        let ds = match (drop, dropped.as_mut()) {
            (Some((p, _)), Some(d)) if p > 0.0 => Some(d.cpu(OP, "dropped", s.probs_len())?),
            _ => None,
        };
        causal_cpu::forward(cpu, qs, ys, ps, ds, s, drop);
        return Ok(());
    }
    // The causal mask: the scores above the diagonal are never read, the probabilities there are 0.
    let scores = Gemm::nt(t, t, hd)
        .lda(3 * c)
        .ldb(3 * c)
        .alpha(s.scale())
        .causal(Causal::Output)
        .batched(
            [s.batch, s.heads],
            s.qkv_stride(),
            s.qkv_stride(),
            s.p_stride(),
        );
    if pairs {
        // Q and K as pairs: K's columns start c / 2 words after Q's.
        let k = Weights::F16(qkv.shift(c / 2));
        matmul_f16_a(be, paths, qkv, k, probs.reborrow(), &scores)?;
    } else {
        matmul(be, paths, qkv, qkv.shift(c), probs.reborrow(), &scores)?;
    }
    let shape = SoftmaxShape::causal(s.batch * s.heads * t, t);
    let mix = Gemm::nn(t, hd, t)
        .lda(t)
        .ldb(3 * c)
        .ldc(c)
        .causal(Causal::ALower)
        .batched(
            [s.batch, s.heads],
            s.p_stride(),
            s.qkv_stride(),
            s.y_stride(),
        );
    if pairs && let Some(mut d) = dropped {
        let drop = drop.filter(|&(p, _)| p > 0.0);
        softmax_dropout_f16(be, probs, d.reborrow(), shape, drop, paths.fault())?;
        let v = Weights::F16(qkv.shift(c));
        return matmul_f16_a_to_pairs(be, paths, d.as_ref(), v, y, &mix);
    }
    let v = qkv.shift(2 * c);
    match (drop, dropped) {
        (Some((p, seed)), Some(mut d)) if p > 0.0 => {
            // The softmax writes the dropped-out probabilities as well, in the same pass.
            let fault = paths.fault();
            softmax_dropout(be, probs.reborrow(), d.reborrow(), shape, (p, seed), fault)?;
            matmul(be, paths, d.as_ref(), v, y.reborrow(), &mix)
        }
        _ => {
            softmax_planted(be, probs.reborrow(), shape, paths.fault())?;
            matmul(be, paths, probs.as_ref(), v, y, &mix)
        }
    }
}

/// Gradients of [`attention_forward`] into `dqkv` (overwritten), given the forward's `probs` (and
/// `dropped`) and the output gradient `dy`. `scratch` holds
/// `probs_len()` elements.
///
/// With `ds_pairs` (`packed_len(probs_len())` words), the forward ran with `pairs` (`qkv` and
/// `dropped` hold f16 pairs), `dy` holds f16 pairs too (attn_proj's backward product wrote them), and
/// the scores' gradient goes to `ds_pairs` as f16 pairs, the values the products dS·K and dSᵀ·Q
/// stage; `dqkv` is then written as f16 pairs too (read only by c_attn's backward products).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    be: &Backend,
    paths: PathSet,
    qkv: TRef<'_>,
    probs: TRef<'_>,
    dropped: Option<TRef<'_>>,
    dy: TRef<'_>,
    dqkv: TMut<'_>,
    mut scratch: TMut<'_>,
    ds_pairs: Option<TMut<'_>>,
    s: AttnShape,
    drop: AttnDropout,
) -> Result<()> {
    let (t, c, hd) = (s.t, s.c(), s.head_dim);
    if ds_pairs.is_some() && (dropped.is_none() || !matches!(be, Backend::Gpu(_)) || c % 2 != 0) {
        return Err(Error::Shape {
            op: "attention_backward",
            msg: "f16 pairs of the probabilities need a GPU, the forward's pairs and an even \
                  width of the heads"
                .into(),
        });
    }
    if let Backend::Cpu(cpu) = be {
        const OP: &str = "attention_backward";
        let (rows, np) = (s.batch * t, s.probs_len());
        let mut dqkv = dqkv;
        causal_cpu::backward(
            cpu,
            qkv.cpu(OP, "qkv", rows * 3 * c)?,
            probs.cpu(OP, "probs", np)?,
            dropped.map(|d| d.cpu(OP, "dropped", np)).transpose()?,
            dy.cpu(OP, "dy", rows * c)?,
            dqkv.cpu(OP, "dqkv", rows * 3 * c)?,
            scratch.cpu(OP, "scratch", np)?,
            s,
            drop,
        );
        return Ok(());
    }
    // dP' = dY Vᵀ (gradient of the probabilities the product saw).
    let pairs = ds_pairs.is_some();
    let dp = Gemm::nt(t, t, hd)
        .lda(c)
        .ldb(3 * c)
        .causal(Causal::Output)
        .batched(
            [s.batch, s.heads],
            s.y_stride(),
            s.qkv_stride(),
            s.p_stride(),
        );
    if pairs {
        let v = Weights::F16(qkv.shift(c));
        matmul_f16_a(be, paths, dy, v, scratch.reborrow(), &dp)?;
    } else {
        matmul(be, paths, dy, qkv.shift(2 * c), scratch.reborrow(), &dp)?;
    }
    // dV = P'ᵀ dY.
    let dv = Gemm::tn(t, hd, t)
        .lda(t)
        .ldb(c)
        .ldc(3 * c)
        .causal(Causal::AUpper)
        .batched(
            [s.batch, s.heads],
            s.p_stride(),
            s.y_stride(),
            s.qkv_stride(),
        );
    let use_drop = matches!(drop, Some((p, _)) if p > 0.0);
    let shape = SoftmaxShape::causal(s.batch * s.heads * t, t);
    // dQ = dS K / √d and dK = dSᵀ Q / √d.
    let dq = Gemm::nn(t, hd, t)
        .lda(t)
        .ldb(3 * c)
        .ldc(3 * c)
        .alpha(s.scale())
        .causal(Causal::ALower)
        .batched(
            [s.batch, s.heads],
            s.p_stride(),
            s.qkv_stride(),
            s.qkv_stride(),
        );
    let dk = Gemm::tn(t, hd, t)
        .lda(t)
        .ldb(3 * c)
        .ldc(3 * c)
        .alpha(s.scale())
        .causal(Causal::AUpper)
        .batched(
            [s.batch, s.heads],
            s.p_stride(),
            s.qkv_stride(),
            s.qkv_stride(),
        );
    if let (Some(mut ds), Some(d)) = (ds_pairs, dropped) {
        // qkv and dqkv as pairs: Q's, K's and V's columns start c / 2 words apart.
        let o = dqkv.offset();
        let (oq, ok, ov) = (o, o + c / 2, o + c);
        let dy = Weights::F16(dy);
        matmul_f16_a_to_pairs(be, paths, d, dy, dqkv.t.at_mut(ov), &dv)?;
        let drop = drop.filter(|_| use_drop);
        softmax_dropout_backward_f16(be, probs, scratch, ds.reborrow(), shape, drop)?;
        let (q, k) = (Weights::F16(qkv), Weights::F16(qkv.shift(c / 2)));
        matmul_f16_a_to_pairs(be, paths, ds.as_ref(), k, dqkv.t.at_mut(oq), &dq)?;
        return matmul_f16_a_to_pairs(be, paths, ds.as_ref(), q, dqkv.t.at_mut(ok), &dk);
    }
    let (oq, ok, ov) = (dqkv.offset(), dqkv.offset() + c, dqkv.offset() + 2 * c);
    {
        let p_used = match (dropped, use_drop) {
            (Some(d), true) => d,
            _ => probs,
        };
        matmul(be, paths, p_used, dy, dqkv.t.at_mut(ov), &dv)?;
    }
    // dP = dropout'(dP'), then dS = softmax'(P, dP), in one pass in place.
    match drop {
        Some((p, seed)) if use_drop => {
            softmax_dropout_backward(be, probs, scratch.reborrow(), shape, (p, seed))?
        }
        _ => softmax_backward(be, probs, scratch.reborrow(), shape)?,
    }
    let ds = scratch;
    matmul(be, paths, ds.as_ref(), qkv.shift(c), dqkv.t.at_mut(oq), &dq)?;
    matmul(be, paths, ds.as_ref(), qkv, dqkv.t.at_mut(ok), &dk)
}

/// Query rows against a KV cache.
#[derive(Clone, Copy, Debug)]
pub struct DecodeShape {
    /// Query rows (1 when decoding, the prompt length when prefilling).
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Row strides of q, of the K and V caches, and of out.
    pub ld_q: usize,
    pub ld_kv: usize,
    pub ld_o: usize,
    /// Position of query row 0; row r sees cache rows 0..=q_pos0 + r.
    pub q_pos0: usize,
    /// Valid rows in the caches (at least q_pos0 + rows).
    pub kv_len: usize,
    /// Sliding window (keys with position > query position − window), 0 for none.
    pub window: usize,
    pub scale: f32,
    /// tanh soft-capping of the scores, 0 for none.
    pub softcap: f32,
}

/// [`dot`] of `a` with four vectors at once (the same arithmetic for each, interleaved: four
/// independent chains).
#[inline(always)]
fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    const LANES: usize = 16;
    let n = a.len() / LANES * LANES;
    let (mut a0, mut a1, mut a2, mut a3) = (
        [0.0f32; LANES],
        [0.0f32; LANES],
        [0.0f32; LANES],
        [0.0f32; LANES],
    );
    let [b0, b1, b2, b3] = b;
    let mut c = 0;
    while c < n {
        let x: &[f32; LANES] = a[c..c + LANES].try_into().unwrap();
        let y0: &[f32; LANES] = b0[c..c + LANES].try_into().unwrap();
        let y1: &[f32; LANES] = b1[c..c + LANES].try_into().unwrap();
        let y2: &[f32; LANES] = b2[c..c + LANES].try_into().unwrap();
        let y3: &[f32; LANES] = b3[c..c + LANES].try_into().unwrap();
        for i in 0..LANES {
            a0[i] += x[i] * y0[i];
            a1[i] += x[i] * y1[i];
            a2[i] += x[i] * y2[i];
            a3[i] += x[i] * y3[i];
        }
        c += LANES;
    }
    let fin = |acc: &[f32; LANES], bk: &[f32]| {
        let tail: f32 = (n..a.len()).map(|i| a[i] * bk[i]).sum();
        acc.iter().sum::<f32>() + tail
    };
    [fin(&a0, b0), fin(&a1, b1), fin(&a2, b2), fin(&a3, b3)]
}

/// Σ a·b over 16 independent partial sums: a serial f32 sum is one long dependency chain that the
/// compiler may not reorder, which made the scores of a long KV cache cost more than a decode step's
/// matrix products.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// One query head at position `qpos` over the cache rows `ks` / `vs` (row j of the sequence at
/// j · `s.ld_kv`), its KV head `kvh`: softmax(scale · q Kᵀ, causal[, window]) V — the CPU twin's
/// arithmetic for one (row, head), shared by [`attend`] and the batched rows of
/// [`rows::attend_rows`] so a row of a batch equals the same row alone bit for bit.
fn head_cpu(
    qr: &[f32],
    ks: &[f32],
    vs: &[f32],
    kvh: usize,
    qpos: usize,
    s: &DecodeShape,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if super::fastmath::avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { head_avx2(qr, ks, vs, kvh, qpos, s) };
    }
    head_body(qr, ks, vs, kvh, qpos, s)
}

/// [`head_body`] built for AVX2 + FMA (the same results: nothing is contracted into an FMA).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head_avx2(
    qr: &[f32],
    ks: &[f32],
    vs: &[f32],
    kvh: usize,
    qpos: usize,
    s: &DecodeShape,
) -> Vec<f32> {
    head_body(qr, ks, vs, kvh, qpos, s)
}

#[inline(always)]
fn head_body(
    qr: &[f32],
    ks: &[f32],
    vs: &[f32],
    kvh: usize,
    qpos: usize,
    s: &DecodeShape,
) -> Vec<f32> {
    let last = (qpos + 1).min(s.kv_len);
    let first = if s.window > 0 {
        (qpos + 1).saturating_sub(s.window)
    } else {
        0
    };
    // Plain loops, no iterator adapters: an adapter's fold compiles to a function of its own, outside
    // `head_avx2`'s build (the closures below are called directly and inlined).
    let mut sc: Vec<f32> = Vec::with_capacity(last.saturating_sub(first));
    let key = |j: usize| &ks[j * s.ld_kv + kvh * s.head_dim..][..s.head_dim];
    let finish = |x: f32| {
        let x = x * s.scale;
        if s.softcap > 0.0 {
            s.softcap * (x / s.softcap).clamp(-15.0, 15.0).tanh()
        } else {
            x
        }
    };
    // Four keys at a time: four independent chains of the same per-key arithmetic as `dot`.
    let mut j = first;
    while j + 4 <= last {
        let d = dot4(qr, [key(j), key(j + 1), key(j + 2), key(j + 3)]);
        sc.extend(d.map(finish));
        j += 4;
    }
    while j < last {
        sc.push(finish(dot(qr, key(j))));
        j += 1;
    }
    let mut m = f32::MIN;
    for &x in &sc {
        m = m.max(x);
    }
    // The exponentials vectorise; their sum stays in order.
    for x in sc.iter_mut() {
        *x = super::fastmath::exp(*x - m);
    }
    let mut sum = 0.0f32;
    for &x in &sc {
        sum += x;
    }
    let inv = 1.0 / sum;
    // o = Σ_j w_j · v_j, each element summed over j in order, 64 elements at a time held in registers.
    let mut o = vec![0.0f32; s.head_dim];
    const W: usize = 64;
    let mut c = 0;
    while c < s.head_dim {
        let len = W.min(s.head_dim - c);
        let mut acc = [0.0f32; W];
        if len == W {
            for (jj, &w) in sc.iter().enumerate() {
                let vr = &vs[(first + jj) * s.ld_kv + kvh * s.head_dim + c..][..W];
                for i in 0..W {
                    acc[i] += w * vr[i];
                }
            }
        } else {
            for (jj, &w) in sc.iter().enumerate() {
                let vr = &vs[(first + jj) * s.ld_kv + kvh * s.head_dim + c..][..len];
                for i in 0..len {
                    acc[i] += w * vr[i];
                }
            }
        }
        o[c..c + len].copy_from_slice(&acc[..len]);
        c += len;
    }
    for x in o.iter_mut() {
        *x *= inv;
    }
    o
}

/// out = softmax(scale · q Kᵀ, causal[, window]) V for each query row and head.
pub fn attend(
    be: &Backend,
    q: TRef<'_>,
    k: TRef<'_>,
    v: TRef<'_>,
    mut out: TMut<'_>,
    s: DecodeShape,
) -> Result<()> {
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) || s.head_dim == 0 || s.head_dim > 512
    {
        return Err(Error::Shape {
            op: "attend",
            msg: format!(
                "heads {} must be a multiple of kv_heads {}; head_dim 1..=512",
                s.heads, s.kv_heads
            ),
        });
    }
    if s.kv_len < s.q_pos0 + s.rows {
        return Err(Error::Shape {
            op: "attend",
            msg: format!(
                "the cache holds {} rows; the queries reach position {}",
                s.kv_len,
                s.q_pos0 + s.rows
            ),
        });
    }
    let span = |rows: usize, ld: usize, w: usize| if rows == 0 { 0 } else { (rows - 1) * ld + w };
    let (nq, nkv, no) = (
        span(s.rows, s.ld_q, s.heads * s.head_dim),
        span(s.kv_len, s.ld_kv, s.kv_heads * s.head_dim),
        span(s.rows, s.ld_o, s.heads * s.head_dim),
    );
    let group = s.heads / s.kv_heads;
    match be {
        Backend::Cpu(c) => {
            let (qs, ks, vs) = (
                q.cpu("attend", "q", nq)?,
                k.cpu("attend", "k", nkv)?,
                v.cpu("attend", "v", nkv)?,
            );
            let os = out.cpu("attend", "out", no)?;
            let results: Vec<(usize, Vec<f32>)> = c.install(|| {
                (0..s.rows * s.heads)
                    .into_par_iter()
                    .map(|gi| {
                        let (r, h) = (gi / s.heads, gi % s.heads);
                        let qr = &qs[r * s.ld_q + h * s.head_dim..][..s.head_dim];
                        let o = head_cpu(qr, ks, vs, h / group, s.q_pos0 + r, &s);
                        (r * s.ld_o + h * s.head_dim, o)
                    })
                    .collect()
            });
            for (off, o) in results {
                os[off..off + s.head_dim].copy_from_slice(&o);
            }
            Ok(())
        }
        Backend::Gpu(g) => {
            let place = |t: TRef<'_>, n: usize, what: &str| -> Result<(wgpu::Buffer, usize)> {
                let tt = t.gpu("attend", "operand", n)?;
                let sg = segments("attend", 1, &[Operand::whole(tt, t.offset(), n.max(1))])
                    .map_err(|_| Error::Shape {
                        op: "attend",
                        msg: format!("{what} must lie in one buffer"),
                    })?;
                Ok((sg[0].places[0].buffer.clone(), sg[0].places[0].offset))
            };
            let (bq, oq) = place(q, nq, "q")?;
            let (bk, ok) = place(k, nkv, "the K cache")?;
            let (bv, ov) = place(v, nkv, "the V cache")?;
            let (bo, oo) = place(out.as_ref(), no, "out")?;
            if s.rows < TILE_ROWS {
                // A few rows (a decode step of the char-level GPT): one workgroup per (row, head)
                // over all its keys at once is shorter than a tile's walk over blocks of keys.
                return attend_few(g, [(&bq, oq), (&bk, ok), (&bv, ov), (&bo, oo)], s);
            }
            // Chunks of 64 dimensions staged per step (attend_tiled.wgsl).
            let nc = s.head_dim.div_ceil(64);
            let pipe = g.pipeline(
                &format!("attend_tiled_c{nc}"),
                &[
                    Access::Read,
                    Access::Read,
                    Access::Read,
                    Access::ReadWrite,
                    Access::ReadWrite,
                ],
                || {
                    let body = repeat_lines(include_str!("attend_tiled.wgsl"), "$c", nc);
                    format!("{PRELUDE}\nconst NC: u32 = {nc}u;\n{body}")
                },
            )?;
            // Splits of the keys: the longest tile's walk is the critical path of the dispatch, so a
            // long prompt spreads it over more workgroups (and a second dispatch merges them), within
            // a bounded scratch.
            let longest = if s.window > 0 {
                s.kv_len.min(s.window + TILE_ROWS)
            } else {
                s.kv_len
            };
            let max = (g.max_chunk_bytes() / 4) as usize;
            let part_len = |n: usize| s.rows * s.heads * n * (s.head_dim + 2);
            let mut n_split = longest.div_ceil(SPLIT_KEYS).clamp(1, MAX_SPLITS);
            while n_split > 1 && part_len(n_split) > max {
                n_split /= 2;
            }
            let split_keys = longest.div_ceil(n_split).next_multiple_of(TILE_KEYS);
            let n_split = longest.div_ceil(split_keys);
            let scratch = if n_split > 1 {
                g.scratch("attend_part", part_len(n_split))?
            } else {
                g.scratch("dummy", 1)?
            };
            let bp = &scratch.chunks[0].buffer;
            let params = [
                s.rows as u32,
                s.heads as u32,
                s.kv_heads as u32,
                s.head_dim as u32,
                s.ld_q as u32,
                s.ld_kv as u32,
                s.ld_o as u32,
                s.q_pos0 as u32,
                s.kv_len as u32,
                s.window as u32,
                s.scale.to_bits(),
                s.softcap.to_bits(),
                oq as u32,
                ok as u32,
                ov as u32,
                oo as u32,
                n_split as u32,
                split_keys as u32,
                0,
            ];
            let groups = [
                s.rows.div_ceil(TILE_ROWS) as u32,
                s.heads as u32,
                n_split as u32,
            ];
            g.dispatch(&pipe, &params, &[&bq, &bk, &bv, &bo, bp], groups)?;
            if n_split > 1 {
                rows::merge_gpu(
                    g,
                    (bp, 0),
                    (&bo, oo),
                    s.rows,
                    s.heads,
                    s.head_dim,
                    s.ld_o,
                    n_split,
                )?;
            }
            Ok(())
        }
    }
}

/// [`attend`] for fewer than [`TILE_ROWS`] rows (attend.wgsl): one workgroup per (row, head), its
/// scores through a scratch row of the cache's length.
fn attend_few(
    g: &crate::gpu::GpuBackend,
    [(bq, oq), (bk, ok), (bv, ov), (bo, oo)]: [(&wgpu::Buffer, usize); 4],
    s: DecodeShape,
) -> Result<()> {
    let pipe = row_kernel(
        g,
        "attend",
        include_str!("attend.wgsl"),
        &[
            Access::Read,
            Access::Read,
            Access::Read,
            Access::ReadWrite,
            Access::ReadWrite,
        ],
    )?;
    // Score scratch: rows · heads · kv_len, in as many dispatches as one binding needs.
    let max = (g.max_chunk_bytes() / 4) as usize;
    let per_row = s.heads * s.kv_len.max(1);
    if per_row > max {
        return Err(Error::Limits(format!(
            "attend: {} heads x {} cached positions of scores exceed one storage binding",
            s.heads, s.kv_len
        )));
    }
    let rows_per = (max / per_row).max(1).min(s.rows.max(1));
    let scratch = g.scratch("attend_scores", rows_per * per_row)?;
    let mut r0 = 0;
    while r0 < s.rows {
        let n = rows_per.min(s.rows - r0);
        let params = [
            n as u32,
            0,
            (oq + r0 * s.ld_q) as u32,
            ok as u32,
            ov as u32,
            (oo + r0 * s.ld_o) as u32,
            s.heads as u32,
            s.kv_heads as u32,
            s.head_dim as u32,
            s.ld_q as u32,
            s.ld_kv as u32,
            s.ld_o as u32,
            s.q_pos0 as u32,
            s.kv_len as u32,
            s.window as u32,
            s.scale.to_bits(),
            s.softcap.to_bits(),
            s.kv_len as u32,
            r0 as u32,
        ];
        let bufs = [bq, bk, bv, bo, &scratch.chunks[0].buffer];
        g.dispatch(&pipe, &params, &bufs, g.grid(n * s.heads))?;
        r0 += n;
    }
    Ok(())
}

/// Query rows and keys of one step of attend_tiled.wgsl (BQ, BK).
const TILE_ROWS: usize = 16;
const TILE_KEYS: usize = 16;
/// Keys one workgroup of the prompt attention aims to walk, and the most splits of a tile's keys.
const SPLIT_KEYS: usize = 128;
const MAX_SPLITS: usize = 8;

mod rows;
pub(crate) use rows::split_len;
pub use rows::{
    Attended, CHUNK, CacheRows, NewRows, RowsShape, attend_new_rows, attend_rows, merge_splits,
};

#[cfg(test)]
mod tests;
