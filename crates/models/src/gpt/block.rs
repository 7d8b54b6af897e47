//! One transformer block of the char-level GPT, written once: [`block_forward`] serves training (a batch
//! of whole sequences, activations kept for the backward pass, dropout) and KV-cache inference (new rows
//! of one sequence, keys and values of earlier rows read from the cache); [`block_backward`] sits beside
//! it, walking the same steps in reverse (llm.c's `*_forward` / `*_backward` pairs).
//!
//! ```text
//!   xmid = x + drop(attn_proj(attention(c_attn(ln_1(x)))))
//!   out  = xmid + drop(mlp_proj(gelu(c_fc(ln_2(xmid)))))
//! ```

use super::layout::BlockOffsets;
use tinygpt_kernels::ops::Grad;
use tinygpt_kernels::ops::attention::{
    AttnDropout, AttnShape, DecodeShape, attend, attention_backward, attention_forward,
};
use tinygpt_kernels::ops::dropout::{dropout, dropout_add, dropout_f16};
use tinygpt_kernels::ops::gelu::{gelu, gelu_backward};
use tinygpt_kernels::ops::matmul::{
    Gemm, Weights, matmul, matmul_f16_a, matmul_f16_a_dropout_add, matmul_f16_a_gelu,
    matmul_f16_a_gelu_backward, matmul_f16_a_to_pairs, packed_len,
};
use tinygpt_kernels::ops::norm::{
    NormKind, NormShape, norm_backward, norm_forward, norm_forward_f16,
};
use tinygpt_kernels::{Backend, DType, Error, PathSet, Result, TMut, TRef, Tensor};

/// LayerNorm's epsilon (nanoGPT's).
pub(crate) const EPS: f32 = 1e-5;

/// The parameters the passes read: the flat f32 tensor, its f16 copy when the runner holds one (the
/// f16-storage path, or a trainer on the tensor-core training path: the block matrices are then read
/// from it), and the path set every product runs on.
#[derive(Clone, Copy)]
pub(crate) struct Params<'a> {
    pub f32: &'a Tensor,
    pub f16: Option<&'a Tensor>,
    pub paths: PathSet,
}

impl<'a> Params<'a> {
    /// The block matrix at parameter offset `w`, from the f16 copy where there is one.
    pub fn matrix(&self, w: usize) -> Weights<'a> {
        match self.f16 {
            // Layout offsets are multiples of 4 · n_embd, so even: word w / 2 starts the matrix.
            Some(p) => Weights::F16(p.at(w / 2)),
            None => self.f32.at(w).into(),
        }
    }

    /// y = x · Wᵀ for the block matrix at parameter offset `w`, x an activation the block keeps (f32,
    /// or f16 pairs: `BlockActs::f16`), y f32 or f16 pairs ([`product`]).
    fn linear_of<'o>(
        &self,
        be: &Backend,
        x: Act<'_>,
        w: usize,
        y: impl Into<Out<'o>>,
        g: &Gemm,
    ) -> Result<()> {
        product(be, self.paths, x, self.matrix(w), y.into(), g)
    }

    /// `out` = `residual` + dropout(x · Wᵀ) with `drop`'s probability and seed: a projection's branch
    /// joining the residual stream. With x as f16 pairs one product ends with the dropout and the
    /// sum (`matmul_f16_a_dropout_add`); else the product into `tmp`, then `dropout_add`.
    #[allow(clippy::too_many_arguments)]
    fn linear_join(
        &self,
        be: &Backend,
        x: Act<'_>,
        w: usize,
        residual: TRef<'_>,
        out: TMut<'_>,
        g: &Gemm,
        drop: (f32, u32),
        tmp: &mut Tensor,
    ) -> Result<()> {
        match x {
            Act::F16(x) => {
                matmul_f16_a_dropout_add(be, self.paths, x, self.matrix(w), residual, out, g, drop)
            }
            Act::F32(_) => {
                self.linear_of(be, x, w, tmp.at_mut(0), g)?;
                dropout_add(be, residual, tmp.at(0), out, g.m * g.n, drop.0, drop.1)
            }
        }
    }
}

/// C = op(A) · op(B) for the forms a block's operands and outputs take: f32, an A of f16 pairs,
/// and an A of pairs writing C as pairs (an output only tensor-core products read). An output of
/// pairs from an f32 A is refused: the pairs belong to the tensor-core training path, whose inputs
/// are pairs too.
fn product<'a>(
    be: &Backend,
    paths: PathSet,
    a: Act<'_>,
    b: impl Into<Weights<'a>>,
    c: Out<'_>,
    g: &Gemm,
) -> Result<()> {
    match (a, c) {
        (Act::F32(a), Out::F32(c)) => matmul(be, paths, a, b, c, g),
        (Act::F16(a), Out::F32(c)) => matmul_f16_a(be, paths, a, b, c, g),
        (Act::F16(a), Out::F16(c)) => matmul_f16_a_to_pairs(be, paths, a, b, c, g),
        (Act::F32(_), Out::F16(_)) => Err(Error::Shape {
            op: "product",
            msg: "an output as f16 pairs needs its input as f16 pairs (the tensor-core training \
                  path)"
                .into(),
        }),
    }
}

/// Sizes of one block call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    /// Token rows in this call.
    pub rows: usize,
    /// Width (n_embd).
    pub c: usize,
    pub heads: usize,
}

impl Dims {
    fn norm(&self) -> NormShape {
        NormShape {
            rows: self.rows,
            cols: self.c,
            eps: EPS,
        }
    }
}

/// Activations of one block: training keeps one set per layer for the backward pass, inference reuses
/// one set for every layer.
///
/// `ln1`, `ln2` and `act` are read only by products: with `f16` they hold f16 pairs (the tensor-core
/// training path, whose products stage exactly those values: half the bytes written and read).
pub(crate) struct BlockActs {
    pub ln1: Tensor,       // ln_1(x) [rows, C]
    pub ln1_stats: Tensor, // [2 rows]
    pub atty: Tensor,      // attention output before the projection [rows, C]
    pub xmid: Tensor,      // residual after the attention branch [rows, C]
    pub ln2: Tensor,
    pub ln2_stats: Tensor,
    pub fc: Tensor,  // MLP hidden before GELU [rows, 4C]
    pub act: Tensor, // after GELU [rows, 4C]
    pub f16: bool,
    /// `atty` holds f16 pairs: attention wrote it with its pairs (`Attention::Batch`), and only
    /// attn_proj's products read it.
    pub atty_pairs: bool,
}

/// An activation or a gradient as a product's operand: f32 values or f16 pairs.
#[derive(Clone, Copy)]
pub(crate) enum Act<'a> {
    F32(TRef<'a>),
    F16(TRef<'a>),
}

impl<'a> Act<'a> {
    /// A zeroed tensor for `len` values split (on the GPU) at multiples of `unit` (even where `f16`),
    /// as [`Act::of`] reads it: f16 pairs if `f16`, else f32.
    pub(crate) fn zeros(be: &Backend, len: usize, unit: usize, f16: bool) -> Result<Tensor> {
        if f16 {
            be.zeros_typed(packed_len(len), unit / 2, DType::U32)
        } else {
            be.zeros(len, unit)
        }
    }

    /// The whole of `t`: f16 pairs if `f16`, else f32.
    fn of(t: &'a Tensor, f16: bool) -> Self {
        if f16 {
            Act::F16(t.at(0))
        } else {
            Act::F32(t.at(0))
        }
    }
}

/// A product's output: f32 values, or f16 pairs (an output only tensor-core products read).
pub(crate) enum Out<'a> {
    F32(TMut<'a>),
    F16(TMut<'a>),
}

impl<'a> Out<'a> {
    /// `t` as f16 pairs if `pairs`, else f32.
    fn of(t: TMut<'a>, pairs: bool) -> Self {
        if pairs { Out::F16(t) } else { Out::F32(t) }
    }
}

impl<'a> From<TMut<'a>> for Out<'a> {
    fn from(t: TMut<'a>) -> Self {
        Out::F32(t)
    }
}

impl<'a> From<TRef<'a>> for Act<'a> {
    fn from(t: TRef<'a>) -> Self {
        Act::F32(t)
    }
}

impl<'a> From<Act<'a>> for Weights<'a> {
    fn from(a: Act<'a>) -> Self {
        match a {
            Act::F32(t) => Weights::F32(t),
            Act::F16(t) => Weights::F16(t),
        }
    }
}

impl BlockActs {
    /// For `rows` token rows of width `c`; tensors holding whole sequences split (on the GPU) at
    /// multiples of `seq` rows; `f16`: the products' inputs as f16 pairs; `atty_pairs`: attention's
    /// output too.
    pub fn new(
        be: &Backend,
        rows: usize,
        c: usize,
        seq: usize,
        f16: bool,
        atty_pairs: bool,
    ) -> Result<Self> {
        let z = |len: usize, unit: usize| be.zeros(len, unit);
        let input = |width: usize| Act::zeros(be, rows * width, width, f16);
        Ok(BlockActs {
            ln1: input(c)?,
            ln1_stats: z(2 * rows, 1)?,
            atty: Act::zeros(be, rows * c, seq * c, atty_pairs)?,
            xmid: z(rows * c, c)?,
            ln2: input(c)?,
            ln2_stats: z(2 * rows, 1)?,
            fc: z(rows * 4 * c, 4 * c)?,
            act: input(4 * c)?,
            f16,
            atty_pairs,
        })
    }

    /// One of the products' inputs (`ln1`, `ln2`, `act`) as an operand.
    fn input<'a>(&self, t: &'a Tensor) -> Act<'a> {
        Act::of(t, self.f16)
    }

    /// ln(x) into one of the products' inputs, as f32 or f16 pairs.
    fn norm(
        f16: bool,
        be: &Backend,
        x: TRef<'_>,
        w: TRef<'_>,
        y: &mut Tensor,
        stats: &mut Tensor,
        s: NormShape,
    ) -> Result<()> {
        let norm = if f16 { norm_forward_f16 } else { norm_forward };
        norm(be, NormKind::Layer, x, w, y.at_mut(0), stats.at_mut(0), s)
    }
}

/// Where the block's attention finds its keys and values.
pub(crate) enum Attention<'a> {
    /// A batch of whole sequences: Q, K and V go to `qkv` [rows, 3C] and the probabilities to `probs`
    /// (and, with dropout, the dropped-out probabilities to `dropped`), all kept for the backward pass.
    /// With `pairs` (the tensor-core training path), `qkv` holds f16 pairs, and `dropped` the values
    /// P·V reads as f16 pairs, with or without dropout (`attention_forward`).
    Batch {
        qkv: &'a mut Tensor,
        probs: &'a mut Tensor,
        dropped: Option<&'a mut Tensor>,
        pairs: bool,
        shape: AttnShape,
        drop: AttnDropout,
    },
    /// New rows of one sequence from position `pos`: their Q, K and V rows go into the cache
    /// [block_size, 3C], whose rows below `pos` hold the earlier positions'.
    Cached { cache: &'a mut Tensor, pos: usize },
}

/// Dropout of the two branches where they join the residual stream: (probability, seed of the
/// attention branch, seed of the MLP branch). Inference passes probability 0.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ResidualDropout {
    pub p: f32,
    pub attn_seed: u32,
    pub mlp_seed: u32,
}

impl ResidualDropout {
    pub const NONE: ResidualDropout = ResidualDropout {
        p: 0.0,
        attn_seed: 0,
        mlp_seed: 0,
    };
}

/// The block's forward pass: `out` = block(`x`), every activation left in `a`. `tmp` holds rows · C.
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_forward(
    be: &Backend,
    w: Params<'_>,
    o: BlockOffsets,
    d: Dims,
    x: TRef<'_>,
    out: TMut<'_>,
    a: &mut BlockActs,
    attn: Attention<'_>,
    drop: ResidualDropout,
    tmp: &mut Tensor,
) -> Result<()> {
    let (n, c) = (d.rows, d.c);
    // Attention branch.
    let p = w.f32;
    BlockActs::norm(
        a.f16,
        be,
        x,
        p.at(o.ln_1),
        &mut a.ln1,
        &mut a.ln1_stats,
        d.norm(),
    )?;
    let qkv_g = Gemm::nt(n, 3 * c, c);
    match attn {
        Attention::Batch {
            qkv,
            probs,
            dropped,
            pairs,
            shape,
            drop,
        } => {
            // With `pairs`, Q, K and V as f16 pairs too: only attention's products read them.
            let qkv_out = Out::of(qkv.at_mut(0), pairs);
            w.linear_of(be, a.input(&a.ln1), o.c_attn, qkv_out, &qkv_g)?;
            attention_forward(
                be,
                w.paths,
                qkv.at(0),
                a.atty.at_mut(0),
                probs.at_mut(0),
                dropped.map(|t| t.at_mut(0)),
                pairs,
                shape,
                drop,
            )?;
        }
        Attention::Cached { cache, pos } => {
            // The new rows' q | k | v land in the cache rows of their positions.
            let qkv = cache.at_mut(pos * 3 * c);
            w.linear_of(be, a.input(&a.ln1), o.c_attn, qkv, &qkv_g)?;
            let hd = c / d.heads;
            let shape = DecodeShape {
                rows: n,
                heads: d.heads,
                kv_heads: d.heads,
                head_dim: hd,
                ld_q: 3 * c,
                ld_kv: 3 * c,
                ld_o: c,
                q_pos0: pos,
                kv_len: pos + n,
                window: 0,
                scale: 1.0 / (hd as f32).sqrt(),
                softcap: 0.0,
            };
            let (q, k, v) = (cache.at(pos * 3 * c), cache.at(c), cache.at(2 * c));
            attend(be, q, k, v, a.atty.at_mut(0), shape)?;
        }
    }
    w.linear_join(
        be,
        Act::of(&a.atty, a.atty_pairs),
        o.attn_proj,
        x,
        a.xmid.at_mut(0),
        &Gemm::nt(n, c, c),
        (drop.p, drop.attn_seed),
        tmp,
    )?;
    // MLP branch.
    let xmid = a.xmid.at(0);
    BlockActs::norm(
        a.f16,
        be,
        xmid,
        p.at(o.ln_2),
        &mut a.ln2,
        &mut a.ln2_stats,
        d.norm(),
    )?;
    let fc = Gemm::nt(n, 4 * c, c);
    if a.f16 {
        // The activation as f16 pairs, written by c_fc's product (`matmul_f16_a_gelu`).
        let (pre, act) = (a.fc.at_mut(0), a.act.at_mut(0));
        let wfc = w.matrix(o.c_fc);
        matmul_f16_a_gelu(be, w.paths, a.ln2.at(0), wfc, pre, act, &fc)?;
    } else {
        w.linear_of(be, a.input(&a.ln2), o.c_fc, a.fc.at_mut(0), &fc)?;
        gelu(be, a.fc.at(0), a.act.at_mut(0), n * 4 * c)?;
    }
    let proj = Gemm::nt(n, c, 4 * c);
    let join = (drop.p, drop.mlp_seed);
    w.linear_join(
        be,
        a.input(&a.act),
        o.mlp_proj,
        a.xmid.at(0),
        out,
        &proj,
        join,
        tmp,
    )
}

/// What the training forward pass kept of one block's attention, for its backward pass.
pub(crate) struct SavedAttention<'a> {
    pub qkv: &'a Tensor,
    pub probs: &'a Tensor,
    /// The dropped-out probabilities the forward pass's product used.
    pub dropped: Option<&'a Tensor>,
    /// `dropped` holds f16 pairs (see [`Attention::Batch`]).
    pub pairs: bool,
    pub shape: AttnShape,
    pub drop: AttnDropout,
}

/// Scratch of the backward pass, shared by every block.
///
/// `dy` and `d4b` are read only by products: with `f16` they hold f16 pairs, as [`BlockActs`] does.
pub(crate) struct BackScratch {
    pub dy: Tensor, // gradient at attn_proj's or mlp_proj's output [rows, C]
    pub dln: Tensor,
    pub datty: Tensor, // f16 pairs where `dprobs_pairs` is kept
    pub dqkv: Tensor,  // f16 pairs where `dprobs_pairs` is kept
    /// The gradient at GELU's output [rows, 4C], f32; none with `f16` (mlp_proj's dX product then
    /// writes `d4b` itself, `matmul_f16_a_gelu_backward`).
    pub d4a: Option<Tensor>,
    pub d4b: Tensor, // gradient at c_fc's output [rows, 4C]
    pub dprobs: Tensor,
    /// The scores' gradient as f16 pairs, where the forward kept its probabilities as pairs.
    pub dprobs_pairs: Option<Tensor>,
    pub f16: bool,
}

impl BackScratch {
    /// For `rows` token rows of width `c` (tensors split at multiples of `seq` rows) and attention
    /// probabilities of `probs` elements (split every `probs_unit`; with `pairs`, their gradient also
    /// as f16 pairs).
    pub fn new(
        be: &Backend,
        (rows, c, seq): (usize, usize, usize),
        (probs, probs_unit, pairs): (usize, usize, bool),
        f16: bool,
    ) -> Result<Self> {
        let z = |len: usize, unit: usize| be.zeros(len, unit);
        let grad = |width: usize, unit: usize| Act::zeros(be, rows * width, unit, f16);
        Ok(BackScratch {
            dy: grad(c, seq * c)?,
            dln: z(rows * c, c)?,
            datty: Act::zeros(be, rows * c, seq * c, pairs)?,
            dqkv: Act::zeros(be, rows * 3 * c, seq * 3 * c, pairs)?,
            d4a: (!f16).then(|| z(rows * 4 * c, 4 * c)).transpose()?,
            d4b: grad(4 * c, 4 * c)?,
            dprobs: z(probs, probs_unit)?,
            dprobs_pairs: match pairs {
                true => Some(Act::zeros(be, probs, probs_unit, true)?),
                false => None,
            },
            f16,
        })
    }

    /// dy = dropout(g) (the gradient at a dropped-out product's output), as f32 or f16 pairs.
    fn dropout_into_dy(
        &mut self,
        be: &Backend,
        g: TRef<'_>,
        n: usize,
        p: f32,
        seed: u32,
    ) -> Result<()> {
        let dropout = if self.f16 { dropout_f16 } else { dropout };
        dropout(be, g, self.dy.at_mut(0), n, p, seed)
    }
}

/// The block's backward pass. `dresid` holds the gradient of the block's output and leaves holding the
/// gradient of its input `x`; the block's parameter gradients are written into `grads` (overwritten).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_backward(
    be: &Backend,
    params: Params<'_>,
    grads: &mut Tensor,
    o: BlockOffsets,
    d: Dims,
    x: TRef<'_>,
    a: &BlockActs,
    attn: SavedAttention<'_>,
    drop: ResidualDropout,
    dresid: &mut Tensor,
    s: &mut BackScratch,
) -> Result<()> {
    let (n, c) = (d.rows, d.c);
    let (w, ln, paths) = (params.f32, NormKind::Layer, params.paths);
    // MLP branch: back through its dropout, mlp_proj, GELU, c_fc and ln_2 (into the residual's gradient).
    s.dropout_into_dy(be, dresid.at(0), n * c, drop.p, drop.mlp_seed)?;
    let (wproj, dw) = (params.matrix(o.mlp_proj), grads.at_mut(o.mlp_proj));
    if s.f16 {
        // dW, then the gradient at c_fc's output as f16 pairs straight from the dX product
        // (`matmul_f16_a_gelu_backward`).
        let dy = Act::F16(s.dy.at(0));
        weight_grad(be, paths, dy, a.input(&a.act), dw, n, c, 4 * c)?;
        let (pre, d4b) = (a.fc.at(0), s.d4b.at_mut(0));
        let g = Gemm::nn(n, 4 * c, c);
        matmul_f16_a_gelu_backward(be, paths, s.dy.at(0), wproj, pre, d4b, &g)?;
    } else {
        let d4a = s.d4a.as_mut().ok_or_else(|| Error::Shape {
            op: "block_backward",
            msg: "the f32 backward pass needs its GELU gradient scratch".into(),
        })?;
        let dmlp = d4a.at_mut(0);
        linear_backward(
            be,
            paths,
            s.dy.at(0),
            a.act.at(0),
            wproj,
            dw,
            dmlp,
            n,
            c,
            4 * c,
        )?;
        gelu_backward(be, a.fc.at(0), d4a.at(0), s.d4b.at_mut(0), n * 4 * c)?;
    }
    let (dln, dw) = (s.dln.at_mut(0), grads.at_mut(o.c_fc));
    linear_backward(
        be,
        paths,
        Act::of(&s.d4b, s.f16),
        a.input(&a.ln2),
        params.matrix(o.c_fc),
        dw,
        dln,
        n,
        4 * c,
        c,
    )?;
    norm_backward(
        be,
        ln,
        a.xmid.at(0),
        w.at(o.ln_2),
        s.dln.at(0),
        a.ln2_stats.at(0),
        dresid.at_mut(0),
        grads.at_mut(o.ln_2),
        d.norm(),
        Grad::Accumulate,
        Grad::Overwrite,
    )?;
    // Attention branch: dresid now holds the gradient of xmid.
    s.dropout_into_dy(be, dresid.at(0), n * c, drop.p, drop.attn_seed)?;
    let (datty, dw) = (s.datty.at_mut(0), grads.at_mut(o.attn_proj));
    linear_backward(
        be,
        paths,
        Act::of(&s.dy, s.f16),
        Act::of(&a.atty, a.atty_pairs),
        params.matrix(o.attn_proj),
        dw,
        Out::of(datty, attn.pairs),
        n,
        c,
        c,
    )?;
    attention_backward(
        be,
        paths,
        attn.qkv.at(0),
        attn.probs.at(0),
        attn.dropped.map(|t| t.at(0)),
        s.datty.at(0),
        s.dqkv.at_mut(0),
        s.dprobs.at_mut(0),
        match attn.pairs {
            true => s.dprobs_pairs.as_mut().map(|t| t.at_mut(0)),
            false => None,
        },
        attn.shape,
        attn.drop,
    )?;
    let (dln, dw) = (s.dln.at_mut(0), grads.at_mut(o.c_attn));
    linear_backward(
        be,
        paths,
        Act::of(&s.dqkv, s.dprobs_pairs.is_some()),
        a.input(&a.ln1),
        params.matrix(o.c_attn),
        dw,
        dln,
        n,
        3 * c,
        c,
    )?;
    norm_backward(
        be,
        ln,
        x,
        w.at(o.ln_1),
        s.dln.at(0),
        a.ln1_stats.at(0),
        dresid.at_mut(0),
        grads.at_mut(o.ln_1),
        d.norm(),
        Grad::Accumulate,
        Grad::Overwrite,
    )
}

/// Gradients of y = x · Wᵀ for `rows` rows (W is `out` x `inp`, f32 or the f16 copy the forward
/// pass read): dW = dyᵀ · x and dx = dy · W, as llm.c's matmul_backward, on the kernels `paths`
/// chooses (f32, or with the tensor-core training path f16 operands, and dx as f16 pairs where only
/// tensor-core products read it).
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_backward<'a, 'o>(
    be: &Backend,
    paths: PathSet,
    dy: impl Into<Act<'a>>,
    x: impl Into<Weights<'a>>,
    w: impl Into<Weights<'a>>,
    dw: TMut<'_>,
    dx: impl Into<Out<'o>>,
    rows: usize,
    out: usize,
    inp: usize,
) -> Result<()> {
    let dy = dy.into();
    weight_grad(be, paths, dy, x, dw, rows, out, inp)?;
    product(be, paths, dy, w, dx.into(), &Gemm::nn(rows, inp, out))
}

/// dW = dyᵀ · x for y = x · Wᵀ over `rows` rows (W is `out` x `inp`): [`linear_backward`]'s first
/// half, for a caller whose dX product ends otherwise.
#[allow(clippy::too_many_arguments)]
fn weight_grad<'a>(
    be: &Backend,
    paths: PathSet,
    dy: Act<'_>,
    x: impl Into<Weights<'a>>,
    dw: TMut<'_>,
    rows: usize,
    out: usize,
    inp: usize,
) -> Result<()> {
    product(be, paths, dy, x, Out::F32(dw), &Gemm::tn(out, inp, rows))
}
