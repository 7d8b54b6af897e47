//! A model's weights on the backend: matrices in the kernels' block-quantized layouts (dense f32 for
//! float tensors), f32 norm vectors, and the projections that read the same input (Q/K/V, gate/up)
//! fused into as few matrices as their layouts allow.
//!
//! Loading is planned first: every tensor the architecture needs is looked up, its shape and type
//! checked, and every tensor of the file must be one the runner uses (a file with RoPE frequency
//! factors, say, would otherwise run with them silently ignored). Only then is anything converted, so a
//! bad file fails fast with one error naming the tensor.
//!
//! Biases (GPT-2 has them on every projection and norm) are f32 vectors added to each output row.

use std::collections::HashSet;

use tinygpt_formats::{GgmlType, GgufFile, KernelWeights};
use tinygpt_kernels::ops::embedding::{EmbedShape, embedding};
use tinygpt_kernels::ops::matmul::fused::{
    Input, Output, Residual, matmul_fused, matmul_residual_norm,
};
use tinygpt_kernels::ops::matmul::{Gemm, QKind, QMatrix, RowMode, get_rows, matmul};
use tinygpt_kernels::{Backend, PathSet, TMut, TRef, Tensor};

use super::config::{Arch, LlmConfig};
use super::error::{LlmError, Result};

/// Loading progress: bytes of tensor data converted so far, of the total.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadProgress {
    pub done: u64,
    pub total: u64,
}

/// A weight matrix (N = rows output features, K = cols input features) resident on the backend.
pub(crate) enum Matrix {
    /// Block-quantized: Q8_0, Q5_0, Q6_K (8-bit layout), Q4_0, Q4_1, Q4_K (4-bit layout).
    Quant(QMatrix),
    /// F32, F16 or BF16 tensors, widened to f32.
    Dense { t: Tensor, rows: usize, cols: usize },
}

impl Matrix {
    /// Puts `h` on `be`; a quantized matrix stays blocks where `paths` has the quantized kernels.
    fn upload(be: &Backend, h: HostMatrix, paths: PathSet) -> Result<Matrix> {
        Ok(match h.w {
            KernelWeights::F32(v) => Matrix::Dense {
                t: be.from_f32(&v, h.cols)?,
                rows: h.rows,
                cols: h.cols,
            },
            KernelWeights::Q8(m) => Matrix::Quant(QMatrix::upload(be, m, paths)?),
            KernelWeights::Q4(m) => Matrix::Quant(QMatrix::upload(be, m, paths)?),
        })
    }

    pub fn rows(&self) -> usize {
        match self {
            Matrix::Quant(q) => q.rows(),
            Matrix::Dense { rows, .. } => *rows,
        }
    }

    /// K, the input features.
    pub fn cols(&self) -> usize {
        match self {
            Matrix::Quant(q) => q.cols(),
            Matrix::Dense { cols, .. } => *cols,
        }
    }

    /// y (+)= input · Wᵀ for the `r.m` rows, with the ops around the product fused into it where a
    /// fused kernel applies (see [`matmul_fused`]).
    pub fn fused(
        &self,
        be: &Backend,
        r: Rows,
        input: Input<'_>,
        y: TMut<'_>,
        out: Output,
    ) -> Result<()> {
        let shape = [r.m, self.rows(), self.cols()];
        match self {
            Matrix::Quant(q) => matmul_fused(be, r.paths, r.mode, input, q, y, shape, out)?,
            Matrix::Dense { t, .. } => matmul_fused(be, r.paths, r.mode, input, t, y, shape, out)?,
        }
        Ok(())
    }

    /// y = RMSNorm(x') · w · Wᵀ after x' = x + RMSNorm(d) · post joins the residual stream, in one
    /// dispatch where the fused kernel applies (see [`matmul_residual_norm`]: x' goes to `next`).
    pub fn residual_norm(
        &self,
        be: &Backend,
        r: Rows,
        x: (TMut<'_>, TMut<'_>),
        d: TRef<'_>,
        norms: (TRef<'_>, TRef<'_>, f32),
        y: TMut<'_>,
    ) -> Result<Residual> {
        let shape = [r.m, self.rows(), self.cols()];
        let out = Output::Store;
        Ok(match self {
            Matrix::Quant(q) => {
                matmul_residual_norm(be, r.paths, r.mode, x, d, norms, q, y, shape, out)?
            }
            Matrix::Dense { t, .. } => {
                matmul_residual_norm(be, r.paths, r.mode, x, d, norms, t, y, shape, out)?
            }
        })
    }

    /// Bytes held on the backend.
    pub fn bytes(&self) -> u64 {
        match self {
            Matrix::Quant(q) => q.bytes(),
            Matrix::Dense { t, .. } => t.bytes(),
        }
    }

    /// The kernel layout, for reports: "q8/32", "q8/16", "q4", "f32", or "f32 (dequantized q4)".
    pub fn layout(&self) -> String {
        match self {
            Matrix::Quant(q) => {
                let kind = match q.kind() {
                    QKind::Q8 { block } => format!("q8/{block}"),
                    QKind::Q4 => "q4".into(),
                };
                // On a GPU whose quantized kernels did not pass the numerics gate.
                if q.is_quantized() {
                    kind
                } else {
                    format!("f32 (dequantized {kind})")
                }
            }
            Matrix::Dense { .. } => "f32".into(),
        }
    }

    /// y[m, N] = x[m, K] · Wᵀ for the `r.m` rows (contiguous from the views' offsets).
    pub fn matmul(&self, be: &Backend, r: Rows, x: TRef<'_>, y: TMut<'_>) -> Result<()> {
        let g = |n: usize, k: usize| Gemm {
            rows: r.mode,
            ..Gemm::nt(r.m, n, k)
        };
        match self {
            Matrix::Quant(q) => matmul(be, r.paths, x, q, y, &g(q.rows(), q.cols()))?,
            Matrix::Dense { t, rows, cols } => matmul(be, r.paths, x, t, y, &g(*rows, *cols))?,
        }
        Ok(())
    }

    /// out[i] = scale · row ids[i] for i < n: the token-embedding lookup.
    pub fn get_rows(
        &self,
        be: &Backend,
        ids: TRef<'_>,
        out: TMut<'_>,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        match self {
            Matrix::Quant(q) => get_rows(be, ids, q, out, n, scale)?,
            Matrix::Dense { t, rows, cols } => {
                let s = EmbedShape {
                    tokens: n,
                    vocab: *rows,
                    dim: *cols,
                    scale,
                };
                embedding(be, ids, t.into(), None, out, s)?
            }
        }
        Ok(())
    }
}

/// How a pass multiplies: on which fast paths, how many token rows, and whether the rows may share work.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows {
    pub paths: PathSet,
    pub m: usize,
    pub mode: RowMode,
}

/// y[r, c] += bias[c] for the `m` rows of `n` (contiguous) elements of `y`: one 1-deep product
/// ones[m x 1] · bias[1 x n] accumulated into y, on either backend in one op, exact (each element gains
/// 1 · bias[c] and nothing else). `ones` holds at least `m` ones.
pub(crate) fn add_bias(
    be: &Backend,
    ones: TRef<'_>,
    bias: &Tensor,
    y: TMut<'_>,
    m: usize,
    n: usize,
) -> Result<()> {
    let g = Gemm::nn(m, n, 1).accumulate();
    Ok(matmul(be, PathSet::F32, ones, bias, y, &g)?)
}

/// A norm's weight and, for LayerNorm with a bias (GPT-2), its bias.
pub(crate) struct Norm {
    pub w: Tensor,
    pub b: Option<Tensor>,
}

impl Norm {
    fn bytes(&self) -> u64 {
        self.w.bytes() + self.b.as_ref().map_or(0, Tensor::bytes)
    }
}

/// A projection and its bias, if it has one.
pub(crate) struct Linear {
    pub w: Matrix,
    pub b: Option<Tensor>,
}

impl Linear {
    fn bytes(&self) -> u64 {
        self.w.bytes() + self.b.as_ref().map_or(0, Tensor::bytes)
    }
}

/// A matrix converted to a kernel layout, still on the host.
struct HostMatrix {
    w: KernelWeights,
    rows: usize,
    cols: usize,
}

/// Which matrices can be stacked into one: same kernel layout and block size.
fn layout_key(w: &KernelWeights) -> (u8, usize) {
    match w {
        KernelWeights::F32(_) => (0, 0),
        KernelWeights::Q8(m) => (1, m.block),
        KernelWeights::Q4(_) => (2, 32),
    }
}

/// Stacks matrices of one layout and width row-wise: every layout is row-major with blocks inside rows,
/// so stacking is concatenating each component array.
fn stack(parts: Vec<HostMatrix>) -> HostMatrix {
    let rows = parts.iter().map(|p| p.rows).sum();
    let cols = parts[0].cols;
    let mut it = parts.into_iter().map(|p| p.w);
    let first = it.next().expect("stack of at least one matrix");
    let w = it.fold(first, |acc, w| match (acc, w) {
        (KernelWeights::F32(mut a), KernelWeights::F32(b)) => {
            a.extend_from_slice(&b);
            KernelWeights::F32(a)
        }
        (KernelWeights::Q8(mut a), KernelWeights::Q8(b)) => {
            a.rows += b.rows;
            a.scales.extend_from_slice(&b.scales);
            a.quants.extend_from_slice(&b.quants);
            KernelWeights::Q8(a)
        }
        (KernelWeights::Q4(mut a), KernelWeights::Q4(b)) => {
            a.rows += b.rows;
            a.scales.extend_from_slice(&b.scales);
            a.mins.extend_from_slice(&b.mins);
            a.quants.extend_from_slice(&b.quants);
            KernelWeights::Q4(a)
        }
        _ => unreachable!("stack is only called on matrices with one layout key"),
    });
    HostMatrix { w, rows, cols }
}

/// Where one member's m x width output lies: from element `offset` of the scratch tensor, rows `ld`
/// apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    pub offset: usize,
    pub ld: usize,
}

/// Projections of one input (Q, K, V or gate, up), stacked into one matrix per kernel layout: one
/// product per layout instead of one per projection (small products are the least efficient calls).
pub(crate) struct Fused {
    groups: Vec<Matrix>,
    /// Per group: the members' biases side by side (zeros for a member without one), if any has one.
    biases: Vec<Option<Tensor>>,
    /// Per member: (group, first output column inside the group).
    members: Vec<(usize, usize)>,
}

impl Fused {
    /// `parts`: each member's matrix and bias.
    fn new(
        be: &Backend,
        parts: Vec<(HostMatrix, Option<Vec<f32>>)>,
        paths: PathSet,
    ) -> Result<Fused> {
        let mut keys: Vec<(u8, usize)> = Vec::new();
        let mut buckets: Vec<Vec<(HostMatrix, Option<Vec<f32>>)>> = Vec::new();
        let mut members = Vec::with_capacity(parts.len());
        for p in parts {
            let key = layout_key(&p.0.w);
            let g = match keys.iter().position(|&k| k == key) {
                Some(g) => g,
                None => {
                    keys.push(key);
                    buckets.push(Vec::new());
                    keys.len() - 1
                }
            };
            members.push((g, buckets[g].iter().map(|h| h.0.rows).sum()));
            buckets[g].push(p);
        }
        let mut groups = Vec::with_capacity(buckets.len());
        let mut biases = Vec::with_capacity(buckets.len());
        for b in buckets {
            let bias = if b.iter().any(|(_, bias)| bias.is_some()) {
                let mut v = Vec::new();
                for (h, bias) in &b {
                    match bias {
                        Some(bias) => v.extend_from_slice(bias),
                        None => v.resize(v.len() + h.rows, 0.0),
                    }
                }
                Some(be.from_f32(&v, v.len())?)
            } else {
                None
            };
            let (mats, _): (Vec<HostMatrix>, Vec<_>) = b.into_iter().unzip();
            groups.push(Matrix::upload(be, stack(mats), paths)?);
            biases.push(bias);
        }
        Ok(Fused {
            groups,
            biases,
            members,
        })
    }

    /// One matrix that already holds several members' rows one after another (GPT-2's `attn_qkv`),
    /// `widths` rows each.
    fn one(
        be: &Backend,
        part: (HostMatrix, Option<Vec<f32>>),
        widths: &[usize],
        paths: PathSet,
    ) -> Result<Fused> {
        let mut f = Fused::new(be, vec![part], paths)?;
        let mut col = 0;
        f.members = widths
            .iter()
            .map(|w| {
                col += w;
                (0, col - w)
            })
            .collect();
        Ok(f)
    }

    /// Runs every group on x[r.m, K] (adding its bias): group g writes its m x N_g output from element
    /// `batch · (N of the groups before g)` of `out`, which holds `batch` x (sum of all N). `ones` holds
    /// at least `r.m` ones (see [`add_bias`]).
    pub fn apply(
        &self,
        be: &Backend,
        r: Rows,
        x: TRef<'_>,
        out: &mut Tensor,
        batch: usize,
        ones: TRef<'_>,
    ) -> Result<()> {
        let mut base = 0;
        for (g, bias) in self.groups.iter().zip(&self.biases) {
            g.matmul(be, r, x, out.at_mut(base))?;
            if let Some(b) = bias {
                add_bias(be, ones, b, out.at_mut(base), r.m, g.rows())?;
            }
            base += batch * g.rows();
        }
        Ok(())
    }

    /// [`Fused::apply`] with the input computed on the way in (a norm of x, fused into each product
    /// where the layout allows).
    pub fn apply_fused(
        &self,
        be: &Backend,
        r: Rows,
        input: Input<'_>,
        out: &mut Tensor,
        batch: usize,
        ones: TRef<'_>,
    ) -> Result<()> {
        let mut base = 0;
        for (g, bias) in self.groups.iter().zip(&self.biases) {
            g.fused(be, r, input, out.at_mut(base), Output::Store)?;
            if let Some(b) = bias {
                add_bias(be, ones, b, out.at_mut(base), r.m, g.rows())?;
            }
            base += batch * g.rows();
        }
        Ok(())
    }

    /// [`Fused::apply_fused`] of RMSNorm(x') · w with x' = x + RMSNorm(d) · post (a post-normed sublayer
    /// output joining the residual stream first): the first group takes the addition in where its
    /// kernel does, writing x' to `next`, the others read it from there; says where x' is.
    #[allow(clippy::too_many_arguments)]
    pub fn apply_residual_norm(
        &self,
        be: &Backend,
        r: Rows,
        (x, next): (&mut Tensor, &mut Tensor),
        d: TRef<'_>,
        (post, w, eps): (TRef<'_>, TRef<'_>, f32),
        out: &mut Tensor,
        batch: usize,
        ones: TRef<'_>,
    ) -> Result<Residual> {
        let mut base = 0;
        let mut how = None;
        for (g, bias) in self.groups.iter().zip(&self.biases) {
            match how {
                None => {
                    let xs = (x.at_mut(0), next.at_mut(0));
                    let y = out.at_mut(base);
                    how = Some(g.residual_norm(be, r, xs, d, (post, w, eps), y)?);
                }
                Some(h) => {
                    let x = if h == Residual::Moved { &*next } else { &*x };
                    let input = Input::RmsNorm { x: x.at(0), w, eps };
                    g.fused(be, r, input, out.at_mut(base), Output::Store)?;
                }
            }
            if let Some(b) = bias {
                add_bias(be, ones, b, out.at_mut(base), r.m, g.rows())?;
            }
            base += batch * g.rows();
        }
        Ok(how.unwrap_or(Residual::InPlace))
    }

    /// Where member `i`'s output lies after [`Fused::apply`].
    pub fn slot(&self, i: usize, batch: usize) -> Slot {
        let (g, col) = self.members[i];
        let before: usize = self.groups[..g].iter().map(|m| m.rows()).sum();
        Slot {
            offset: batch * before + col,
            ld: self.groups[g].rows(),
        }
    }

    pub fn bytes(&self) -> u64 {
        self.groups.iter().map(Matrix::bytes).sum::<u64>()
            + self.biases.iter().flatten().map(Tensor::bytes).sum::<u64>()
    }

    /// "q8/32" for one group, "q4+q8/16" for two.
    pub fn layout(&self) -> String {
        self.groups
            .iter()
            .map(Matrix::layout)
            .collect::<Vec<_>>()
            .join("+")
    }

    pub fn num_members(&self) -> usize {
        self.members.len()
    }

    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
}

/// One transformer block.
pub(crate) struct LayerWeights {
    pub attn_norm: Norm,
    /// Members: Q, K, V.
    pub qkv: Fused,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub wo: Linear,
    pub post_attn_norm: Option<Tensor>,
    pub ffn_norm: Norm,
    /// Members: gate, up (a gated FFN) or up alone.
    pub gate_up: Fused,
    pub down: Linear,
    pub post_ffn_norm: Option<Tensor>,
}

pub(crate) struct Weights {
    pub embed: Matrix,
    /// Learned positions (GPT-2), one row per position the model was trained for.
    pub pos_embd: Option<Matrix>,
    /// The output projection; None when tied to the embeddings (no `output.weight`).
    pub head: Option<Matrix>,
    pub output_norm: Norm,
    pub layers: Vec<LayerWeights>,
}

impl Weights {
    pub fn head(&self) -> &Matrix {
        self.head.as_ref().unwrap_or(&self.embed)
    }

    pub fn bytes(&self) -> u64 {
        let ov = |t: &Option<Tensor>| t.as_ref().map_or(0, |t| t.bytes());
        self.embed.bytes()
            + self.pos_embd.as_ref().map_or(0, Matrix::bytes)
            + self.head.as_ref().map_or(0, Matrix::bytes)
            + self.output_norm.bytes()
            + self
                .layers
                .iter()
                .map(|l| {
                    l.attn_norm.bytes()
                        + l.qkv.bytes()
                        + ov(&l.q_norm)
                        + ov(&l.k_norm)
                        + l.wo.bytes()
                        + ov(&l.post_attn_norm)
                        + l.ffn_norm.bytes()
                        + l.gate_up.bytes()
                        + l.down.bytes()
                        + ov(&l.post_ffn_norm)
                })
                .sum::<u64>()
    }

    /// Plans, checks and loads every tensor of `file` for `cfg`. With `release_pages` (only for a
    /// memory-mapped file), each tensor's pages leave the resident set once converted.
    pub fn load(
        be: &Backend,
        file: &GgufFile,
        cfg: &LlmConfig,
        progress: &mut dyn FnMut(LoadProgress),
        release_pages: bool,
        paths: PathSet,
    ) -> Result<Weights> {
        let plan = Plan::new(file, cfg)?;
        let mut ld = Loader {
            be,
            paths,
            file,
            release_pages,
            done: 0,
            total: plan.total_bytes,
            progress,
        };
        (ld.progress)(LoadProgress {
            done: 0,
            total: ld.total,
        });
        let gpt2 = cfg.arch == Arch::Gpt2;
        let embed = ld.matrix("token_embd.weight")?;
        let pos_embd = if cfg.learned_positions {
            Some(ld.matrix("position_embd.weight")?)
        } else {
            None
        };
        let head = if plan.has_output {
            Some(ld.matrix("output.weight")?)
        } else {
            None
        };
        let output_norm = ld.norm("output_norm", gpt2)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |t: &str| format!("blk.{i}.{t}.weight");
            let bias = |t: &str| format!("blk.{i}.{t}.bias");
            let opt_vec = |ld: &mut Loader<'_>, t: &str, on: bool| -> Result<Option<Tensor>> {
                if on {
                    ld.vector(&n(t)).map(Some)
                } else {
                    Ok(None)
                }
            };
            let opt_bias = |ld: &mut Loader<'_>, t: &str| -> Result<Option<Vec<f32>>> {
                if gpt2 {
                    ld.host_vector(&bias(t)).map(Some)
                } else {
                    Ok(None)
                }
            };
            let attn_norm = ld.norm(&format!("blk.{i}.attn_norm"), gpt2)?;
            let qkv = if gpt2 {
                let w = ld.host(&n("attn_qkv"))?;
                let b = opt_bias(&mut ld, "attn_qkv")?;
                let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
                Fused::one(be, (w, b), &[qd, kvd, kvd], paths)?
            } else {
                // Q/K/V biases where the file has them (Qwen2).
                let mut parts = Vec::with_capacity(3);
                for t in ["attn_q", "attn_k", "attn_v"] {
                    let w = ld.host(&n(t))?;
                    let b = if plan.has(&bias(t)) {
                        Some(ld.host_vector(&bias(t))?)
                    } else {
                        None
                    };
                    parts.push((w, b));
                }
                Fused::new(be, parts, paths)?
            };
            let q_norm = opt_vec(&mut ld, "attn_q_norm", cfg.qk_norm)?;
            let k_norm = opt_vec(&mut ld, "attn_k_norm", cfg.qk_norm)?;
            let wo = ld.linear(i, "attn_output", gpt2)?;
            let post_attn_norm = opt_vec(&mut ld, "post_attention_norm", cfg.post_norms)?;
            let ffn_norm = ld.norm(&format!("blk.{i}.ffn_norm"), gpt2)?;
            let gate_up = if cfg.gated_ffn {
                let gate = ld.host(&n("ffn_gate"))?;
                let up = ld.host(&n("ffn_up"))?;
                Fused::new(be, vec![(gate, None), (up, None)], paths)?
            } else {
                let up = ld.host(&n("ffn_up"))?;
                let b = opt_bias(&mut ld, "ffn_up")?;
                Fused::new(be, vec![(up, b)], paths)?
            };
            let down = ld.linear(i, "ffn_down", gpt2)?;
            let post_ffn_norm = opt_vec(&mut ld, "post_ffw_norm", cfg.post_norms)?;
            layers.push(LayerWeights {
                attn_norm,
                qkv,
                q_norm,
                k_norm,
                wo,
                post_attn_norm,
                ffn_norm,
                gate_up,
                down,
                post_ffn_norm,
            });
        }
        Ok(Weights {
            embed,
            pos_embd,
            head,
            output_norm,
            layers,
        })
    }
}

/// Whether the kernels have a layout for `t` as a matrix.
fn matrix_type_supported(t: GgmlType) -> bool {
    matches!(
        t,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q5_0
            | GgmlType::Q6_K
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q4_K
    )
}

/// The checked list of tensors to load.
struct Plan {
    total_bytes: u64,
    has_output: bool,
    /// Optional tensors the file has.
    optional: HashSet<String>,
}

impl Plan {
    fn new(file: &GgufFile, cfg: &LlmConfig) -> Result<Plan> {
        let (d, qd, kvd, ff, hd, v) = (
            cfg.d_model,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.n_ff,
            cfg.head_dim,
            cfg.vocab,
        );
        let has_output = file.tensor("output.weight").is_some();
        let gpt2 = cfg.arch == Arch::Gpt2;
        let mut optional = HashSet::new();
        // (name, rows, cols, is a matrix); a vector has one row.
        let mut want: Vec<(String, usize, usize, bool)> = vec![
            ("token_embd.weight".into(), v, d, true),
            ("output_norm.weight".into(), 1, d, false),
        ];
        if has_output {
            want.push(("output.weight".into(), v, d, true));
        }
        if cfg.learned_positions {
            want.push(("position_embd.weight".into(), cfg.train_context, d, true));
        }
        if gpt2 {
            want.push(("output_norm.bias".into(), 1, d, false));
        }
        for i in 0..cfg.n_layer {
            let n = |t: &str| format!("blk.{i}.{t}.weight");
            let b = |t: &str| format!("blk.{i}.{t}.bias");
            want.push((n("attn_norm"), 1, d, false));
            if gpt2 {
                want.push((n("attn_qkv"), qd + 2 * kvd, d, true));
            } else {
                want.extend([
                    (n("attn_q"), qd, d, true),
                    (n("attn_k"), kvd, d, true),
                    (n("attn_v"), kvd, d, true),
                ]);
            }
            want.extend([
                (n("attn_output"), d, qd, true),
                (n("ffn_norm"), 1, d, false),
            ]);
            if cfg.gated_ffn {
                want.push((n("ffn_gate"), ff, d, true));
            }
            want.extend([(n("ffn_up"), ff, d, true), (n("ffn_down"), d, ff, true)]);
            if gpt2 {
                want.extend([
                    (b("attn_qkv"), 1, qd + 2 * kvd, false),
                    (b("attn_norm"), 1, d, false),
                    (b("attn_output"), 1, d, false),
                    (b("ffn_norm"), 1, d, false),
                    (b("ffn_up"), 1, ff, false),
                    (b("ffn_down"), 1, d, false),
                ]);
            }
            // Optional Q/K/V biases (llama.cpp `create_tensor_qkv`: Qwen2 has them).
            if matches!(cfg.arch, Arch::Qwen2 | Arch::Qwen3) {
                for (t, width) in [("attn_q", qd), ("attn_k", kvd), ("attn_v", kvd)] {
                    if file.tensor(&b(t)).is_some() {
                        optional.insert(b(t));
                        want.push((b(t), 1, width, false));
                    }
                }
            }
            if cfg.qk_norm {
                want.extend([
                    (n("attn_q_norm"), 1, hd, false),
                    (n("attn_k_norm"), 1, hd, false),
                ]);
            }
            if cfg.post_norms {
                want.extend([
                    (n("post_attention_norm"), 1, d, false),
                    (n("post_ffw_norm"), 1, d, false),
                ]);
            }
        }
        let mut total_bytes = 0u64;
        let mut names = HashSet::with_capacity(want.len());
        for (name, rows, cols, is_matrix) in &want {
            let info = file.tensor_info(name)?;
            if info.cols() != *cols as u64 || info.rows() != *rows as u64 {
                return Err(LlmError::Invalid(format!(
                    "tensor '{name}' has shape {:?}; the hyperparameters call for {cols} x {rows} (ne0 x ne1)",
                    info.dims
                )));
            }
            let t = info.ggml_type;
            let ok = if *is_matrix {
                matrix_type_supported(t)
            } else {
                t.can_dequantize()
            };
            if !ok {
                return Err(LlmError::UnsupportedTensorType {
                    tensor: name.clone(),
                    ggml_type: t,
                });
            }
            total_bytes += info.n_bytes;
            names.insert(name.as_str());
        }
        if let Some(extra) = file
            .tensors()
            .iter()
            .find(|t| !names.contains(t.name.as_str()))
        {
            return Err(LlmError::Unsupported(format!(
                "tensor '{}' ({} architecture): the runner does not implement what it is for",
                extra.name,
                cfg.arch.name()
            )));
        }
        Ok(Plan {
            total_bytes,
            has_output,
            optional,
        })
    }

    /// Whether the optional tensor `name` is in the file (and so in the plan).
    fn has(&self, name: &str) -> bool {
        self.optional.contains(name)
    }
}

struct Loader<'a> {
    be: &'a Backend,
    paths: PathSet,
    file: &'a GgufFile,
    release_pages: bool,
    done: u64,
    total: u64,
    progress: &'a mut dyn FnMut(LoadProgress),
}

impl Loader<'_> {
    fn advance(&mut self, name: &str) -> Result<()> {
        let info = self.file.tensor_info(name)?;
        if self.release_pages {
            release_pages(self.file.tensor_data(info)?);
        }
        self.done += info.n_bytes;
        (self.progress)(LoadProgress {
            done: self.done,
            total: self.total,
        });
        Ok(())
    }

    /// A matrix in its kernel layout, on the host (shape and type were checked by the plan), checked
    /// finite.
    fn host(&mut self, name: &str) -> Result<HostMatrix> {
        let info = self.file.tensor_info(name)?;
        let (rows, cols) = (info.rows() as usize, info.cols() as usize);
        let w = self.file.load_matrix(name)?;
        if let Some((what, bad)) = w.first_non_finite() {
            return Err(LlmError::Invalid(format!(
                "tensor '{name}' holds a non-finite {what} ({bad}): the file is damaged"
            )));
        }
        self.advance(name)?;
        Ok(HostMatrix { w, rows, cols })
    }

    fn matrix(&mut self, name: &str) -> Result<Matrix> {
        let h = self.host(name)?;
        Matrix::upload(self.be, h, self.paths)
    }

    /// A vector (norm weight, bias) as f32 on the host, checked finite.
    fn host_vector(&mut self, name: &str) -> Result<Vec<f32>> {
        let v = self.file.dequantize(name)?;
        if let Some(bad) = v.iter().find(|x| !x.is_finite()) {
            return Err(LlmError::Invalid(format!(
                "tensor '{name}' holds a non-finite value ({bad})"
            )));
        }
        self.advance(name)?;
        Ok(v)
    }

    fn vector(&mut self, name: &str) -> Result<Tensor> {
        let v = self.host_vector(name)?;
        Ok(self.be.from_f32(&v, v.len().max(1))?)
    }

    /// `{prefix}.weight`, and `{prefix}.bias` when the norms have biases.
    fn norm(&mut self, prefix: &str, with_bias: bool) -> Result<Norm> {
        let w = self.vector(&format!("{prefix}.weight"))?;
        let b = with_bias
            .then(|| self.vector(&format!("{prefix}.bias")))
            .transpose()?;
        Ok(Norm { w, b })
    }

    /// Layer `i`'s projection `t`, with its bias when the projections have biases.
    fn linear(&mut self, i: usize, t: &str, with_bias: bool) -> Result<Linear> {
        let w = self.matrix(&format!("blk.{i}.{t}.weight"))?;
        let b = with_bias
            .then(|| self.vector(&format!("blk.{i}.{t}.bias")))
            .transpose()?;
        Ok(Linear { w, b })
    }
}

/// Drops the whole pages of a converted tensor's data from the resident set, so loading peaks at the
/// converted weights plus one tensor's worth of file, not the converted weights plus the whole file.
/// The caller guarantees `data` lies in a read-only mapping of a file: such pages are reread from the file
/// if touched again, unchanged (in anonymous memory, MADV_DONTNEED would zero them instead).
#[cfg(unix)]
fn release_pages(data: &[u8]) {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .unwrap_or(4096)
        .max(1);
    let start = (data.as_ptr() as usize).next_multiple_of(page);
    let end = (data.as_ptr() as usize + data.len()) / page * page;
    if end > start {
        // SAFETY: [start, end) lies inside `data`, a file mapping (see above); the advice changes no
        // byte a reader of the mapping can observe. A failure only leaves the pages resident.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    }
}

#[cfg(not(unix))]
fn release_pages(_: &[u8]) {}
