//! The cooperative-matrix fast path: x · Wᵀ on the tensor cores through wgpu's experimental
//! cooperative-matrix extension — f16 inputs, f32 accumulation, 16x16x16 fragments.
//!
//! A workgroup of four 32-lane subgroups computes a 64x64 tile of C, each subgroup a 32x32 quarter as
//! 2x2 fragments. Tiles of x (f32, rounded to f16) and W (f16-packed) are staged through workgroup
//! memory: naga 30's SPIR-V writer panics on cooperative loads from storage arrays at runtime indices,
//! but loads from workgroup arrays work. Every index and stride is a `let` of its own for the same
//! reason. The pipeline is built where a panic becomes a failed gate ([`crate::gpu`]'s pipeline builder
//! catches it), never a crashed program.
//!
//! The training kernel (`mixed_source`, on the tile shapes of [`MixedTile`]) stages f32 operands
//! the same way and stores whole fragments straight to C in storage (`coopStoreT` with each index a
//! `let`), which naga 30.0.2 writes and the H100's driver runs.

use super::tiled::{PARAMS, causal_key, causal_prologue};
use super::{Causal, Gemm};
use crate::error::{Error, Result};
use crate::gpu::{Access, GpuBackend, GpuTensor};
use crate::path::Fault;

/// Whether a product is one the cooperative kernel takes: x · Wᵀ, unbatched, tall enough to fill tiles.
pub(super) fn suits(g: &Gemm) -> bool {
    !g.trans_a && g.trans_b && g.batches() == 1 && g.m >= 64 && g.n >= 64 && g.k >= 64
}

fn source(fault: Option<Fault>) -> String {
    let tail = match fault {
        Some(Fault::OutOfBoundsWrite) => {
            "  if (lid == 0u && wid.x == 0u && wid.y == 0u) { mat_c[p.c_off + p.m * p.ldc] = 1.0; }"
        }
        Some(Fault::NanOutput) => {
            "  if (lid == 0u && wid.x == 0u && wid.y == 0u) { mat_c[p.c_off] = bitcast<f32>(0x7fc00000u); }"
        }
        _ => "",
    };
    format!(
        "enable f16;
enable wgpu_cooperative_matrix;
struct Params {{ m: u32, n: u32, k: u32, lda: u32, ldb: u32, ldc: u32, a_off: u32, b_off: u32, c_off: u32, alpha: f32, beta: f32 }}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> mat_a: array<f32>;
@group(0) @binding(2) var<storage, read> mat_b: array<u32>;
@group(0) @binding(3) var<storage, read_write> mat_c: array<f32>;

var<workgroup> As: array<f16, 2048>; // 64 rows x 32 k, row-major
var<workgroup> Bs: array<f16, 2048>; // 32 k x 64 cols, row-major
var<workgroup> Cs: array<f32, 1024>; // one 16x16 fragment per subgroup

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let row0 = wid.y * 64u;
  let col0 = wid.x * 64u;
  let sg = lid / 32u;
  let sr = (sg / 2u) * 32u;
  let sc = (sg % 2u) * 32u;
  var c00 = coop_mat16x16<f32, C>();
  var c01 = coop_mat16x16<f32, C>();
  var c10 = coop_mat16x16<f32, C>();
  var c11 = coop_mat16x16<f32, C>();
  let s32 = 32u;
  let s64 = 64u;
  for (var k0 = 0u; k0 < p.k; k0 = k0 + 32u) {{
    for (var i = 0u; i < 16u; i = i + 1u) {{
      let e = i * 128u + lid;
      let r = e / 32u;
      let kk = e % 32u;
      var v = 0.0;
      if (row0 + r < p.m && k0 + kk < p.k) {{ v = mat_a[p.a_off + (row0 + r) * p.lda + k0 + kk]; }}
      As[e] = f16(v);
      var wv = 0.0;
      if (col0 + r < p.n && k0 + kk < p.k) {{
        let idx = p.b_off + (col0 + r) * p.ldb + k0 + kk;
        wv = unpack2x16float(mat_b[idx >> 1u])[idx & 1u];
      }}
      Bs[kk * 64u + r] = f16(wv);
    }}
    workgroupBarrier();
    for (var kk = 0u; kk < 32u; kk = kk + 16u) {{
      let ia0 = sr * 32u + kk;
      let ia1 = (sr + 16u) * 32u + kk;
      let ib0 = kk * 64u + sc;
      let ib1 = kk * 64u + sc + 16u;
      let a0 = coopLoadT<coop_mat16x16<f16, A>>(&As[ia0], s32);
      let a1 = coopLoadT<coop_mat16x16<f16, A>>(&As[ia1], s32);
      let b0 = coopLoadT<coop_mat16x16<f16, B>>(&Bs[ib0], s64);
      let b1 = coopLoadT<coop_mat16x16<f16, B>>(&Bs[ib1], s64);
      c00 = coopMultiplyAdd(a0, b0, c00);
      c01 = coopMultiplyAdd(a0, b1, c01);
      c10 = coopMultiplyAdd(a1, b0, c10);
      c11 = coopMultiplyAdd(a1, b1, c11);
    }}
    workgroupBarrier();
  }}
  let lane = lid % 32u;
  let cbase = sg * 256u;
  let s16 = 16u;
{stores}
{tail}
}}
",
        stores = (0..4)
            .map(|f| {
                let (fr, fc) = (f / 2, f % 2);
                format!(
                    "  coopStoreT(c{fr}{fc}, &Cs[cbase], s16);
  workgroupBarrier();
  for (var j = 0u; j < 8u; j = j + 1u) {{
    let e = j * 32u + lane;
    let r = row0 + sr + {}u + e / 16u;
    let c = col0 + sc + {}u + e % 16u;
    if (r < p.m && c < p.n) {{
      let ci = p.c_off + r * p.ldc + c;
      var v = p.alpha * Cs[cbase + e];
      if (p.beta != 0.0) {{ v = v + p.beta * mat_c[ci]; }}
      mat_c[ci] = v;
    }}
  }}
  workgroupBarrier();",
                    16 * fr,
                    16 * fc
                )
            })
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

/// C = alpha · A · Bᵀ + beta · C on the tensor cores, B packed f16 (`b` offset and `g.ldb` in f16
/// elements). Single-buffer operands only.
pub(crate) fn matmul_coop(
    gb: &GpuBackend,
    (ta, oa): (&GpuTensor, usize),
    (tb, ob): (&GpuTensor, usize),
    (tc, oc): (&GpuTensor, usize),
    g: &Gemm,
    fault: Option<Fault>,
) -> Result<()> {
    if ta.num_chunks() != 1
        || tb.num_chunks() != 1
        || tc.num_chunks() != 1
        || g.trans_a
        || !g.trans_b
    {
        return Err(Error::Shape {
            op: "matmul_coop",
            msg: "the cooperative kernel takes x·Wᵀ with every operand in one buffer".into(),
        });
    }
    let key = format!(
        "gemm_coop{}",
        fault.map_or(String::new(), |f| format!("_fault{f:?}"))
    );
    let pipe = gb.pipeline(
        &key,
        &[Access::Read, Access::Read, Access::ReadWrite],
        || source(fault),
    )?;
    let p = [
        g.m as u32,
        g.n as u32,
        g.k as u32,
        g.lda as u32,
        g.ldb as u32,
        g.ldc as u32,
        oa as u32,
        ob as u32,
        oc as u32,
        g.alpha.to_bits(),
        g.beta.to_bits(),
    ];
    let bufs = [
        &ta.chunks[0].buffer,
        &tb.chunks[0].buffer,
        &tc.chunks[0].buffer,
    ];
    gb.dispatch(
        &pipe,
        &p,
        &bufs,
        [g.n.div_ceil(64) as u32, g.m.div_ceil(64) as u32, 1],
    )
}

/// Operand values a thread of the mixed-precision kernel stages together: consecutive along the
/// rows its tile is stored in (k, or m / n), rounded to f16 and stored as one `vec2<f16>`, half the
/// workgroup-memory stores of one f16 each (H100, `bench train` on the tensor cores: 19.55 → 18.60
/// ms/iter; four at a time, 19.86). The tiles are arrays of `vec2<f16>`, so fragment loads address
/// them and stride through them in pairs.
const RUN: usize = 2;

/// One shape of the mixed-precision kernel: the workgroup's tile of C, how its subgroups split it,
/// the k-step, and two ways of cutting work from tiles that lie wholly inside the matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MixedTile {
    /// Rows and columns of C a workgroup computes.
    pub tm: usize,
    pub tn: usize,
    /// Subgroups (32 lanes) along the rows and the columns of the tile.
    pub sgm: usize,
    pub sgn: usize,
    /// Elements of k staged per step.
    pub bk: usize,
    /// Tiles wholly inside C with beta = 0 store their fragments straight to C (scaled by alpha),
    /// not through workgroup memory a fragment at a time.
    pub direct_store: bool,
    /// Operand tiles wholly inside their matrices, and k-steps wholly inside K, load without
    /// per-element bounds checks.
    pub unchecked: bool,
    /// The next k-step's global loads are issued before the current one is multiplied (register
    /// double-buffering); without, each step loads, stores and multiplies in turn, with fewer
    /// registers live.
    pub prefetch: bool,
}

impl MixedTile {
    /// The products of a training step's linear layers and weight gradients (long M, K of 384 and
    /// more): 128x128 tiles of eight subgroups, 64 of k a step.
    pub const LARGE: MixedTile = MixedTile {
        tm: 128,
        tn: 128,
        sgm: 2,
        sgn: 4,
        bk: 64,
        direct_store: true,
        unchecked: false,
        prefetch: true,
    };
    /// [`MixedTile::LARGE`] with 32 of k a step, for adapters with less workgroup memory.
    pub const LARGE_K32: MixedTile = MixedTile {
        bk: 32,
        ..MixedTile::LARGE
    };
    /// Batches of small products (attention's, 256 x 256 and less per (sequence, head)): 64x64 tiles
    /// of four subgroups, so the batch spreads over more workgroups.
    pub const SMALL: MixedTile = MixedTile {
        tm: 64,
        tn: 64,
        sgm: 2,
        sgn: 2,
        bk: 32,
        direct_store: true,
        unchecked: true,
        prefetch: true,
    };

    /// Shapes `bench ops --tiles` times beside the chosen ones.
    pub const CANDIDATES: [MixedTile; 11] = [
        MixedTile {
            tm: 256,
            sgm: 4,
            sgn: 2,
            bk: 32,
            ..MixedTile::LARGE
        },
        MixedTile {
            tn: 256,
            bk: 32,
            ..MixedTile::LARGE
        },
        MixedTile::LARGE,
        MixedTile {
            prefetch: false,
            ..MixedTile::LARGE
        },
        MixedTile::LARGE_K32,
        MixedTile {
            prefetch: false,
            ..MixedTile::LARGE_K32
        },
        MixedTile::SMALL,
        MixedTile {
            prefetch: false,
            ..MixedTile::SMALL
        },
        MixedTile {
            sgn: 2,
            bk: 32,
            prefetch: false,
            ..MixedTile::LARGE
        },
        MixedTile {
            tm: 128,
            sgm: 2,
            ..MixedTile::SMALL
        },
        MixedTile {
            direct_store: false,
            ..MixedTile::LARGE_K32
        },
    ];

    fn threads(&self) -> usize {
        32 * self.sgm * self.sgn
    }

    /// Workgroup memory the kernel declares, in bytes (the larger of each operand's two layouts, and
    /// one f32 fragment per subgroup).
    pub fn shared_bytes(&self) -> usize {
        let (ks, bk) = (self.bk + 8, self.bk);
        let a = (self.tm * ks).max(bk * (self.tm + 8));
        let b = (self.tn * ks).max(bk * (self.tn + 8));
        2 * (a + b) + 4 * 256 * self.threads() / 32
    }

    pub fn key(&self) -> String {
        format!(
            "{}x{}_{}x{}_k{}{}{}{}",
            self.tm,
            self.tn,
            self.sgm,
            self.sgn,
            self.bk,
            if self.direct_store { "_ds" } else { "" },
            if self.unchecked { "_uc" } else { "" },
            if self.prefetch { "" } else { "_np" },
        )
    }
}

/// The tile a product runs on: [`MixedTile::SMALL`] for batches of products of at most 256 x 256,
/// else [`large_tile`].
pub(super) fn mixed_tile(gb: &GpuBackend, g: &Gemm) -> MixedTile {
    if g.batches() > 1 && g.m * g.n <= 256 * 256 {
        MixedTile::SMALL
    } else {
        large_tile(gb)
    }
}

/// [`MixedTile::LARGE`] where the adapter's workgroup memory holds it, else [`MixedTile::LARGE_K32`].
fn large_tile(gb: &GpuBackend) -> MixedTile {
    let room = gb.limits.max_compute_workgroup_storage_size as usize;
    if MixedTile::LARGE.shared_bytes() <= room {
        MixedTile::LARGE
    } else {
        MixedTile::LARGE_K32
    }
}

/// The tiles [`mixed_tile`] can choose on this adapter (what the path's gate checks).
pub(crate) fn mixed_tiles(gb: &GpuBackend) -> Vec<MixedTile> {
    vec![large_tile(gb), MixedTile::SMALL]
}

/// How one operand of the tensor-core training kernel is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Storage {
    /// f32 elements, each rounded to f16 as it is staged.
    F32,
    /// f16 values packed two per u32 word ([`super::pack_f16`]), staged as they are: half the bytes
    /// each tile reads. The operand's extents, offset, leading dimension and batch strides are even,
    /// so each staged pair is one word.
    F16,
}

impl Storage {
    /// `F16` if `f16`, else `F32`.
    pub fn of(f16: bool) -> Storage {
        if f16 { Storage::F16 } else { Storage::F32 }
    }
}

/// How the tensor-core training kernel's two operands, and its output, are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operands {
    pub a: Storage,
    pub b: Storage,
    /// C as f16 pairs: each value rounded once, as [`super::pack_f16`] rounds (beta must be 0), for
    /// an output only tensor-core products read.
    pub c: Storage,
}

impl Operands {
    /// Both f32.
    pub const F32: Operands = Operands {
        a: Storage::F32,
        b: Storage::F32,
        c: Storage::F32,
    };
    /// Both f16 pairs (C f32).
    pub const F16: Operands = Operands {
        a: Storage::F16,
        b: Storage::F16,
        c: Storage::F32,
    };

    /// `a` and `b`, C f32.
    pub fn of(a: Storage, b: Storage) -> Operands {
        Operands {
            a,
            b,
            c: Storage::F32,
        }
    }

    /// Whether the kernel can stage `g`'s operands as stored: each f16 operand's extents, leading
    /// dimension and batch strides even ([`f16_a_suits`], [`f16_b_suits`]).
    pub(super) fn suit(&self, g: &Gemm) -> bool {
        (self.a == Storage::F32 || f16_a_suits(g))
            && (self.b == Storage::F32 || f16_b_suits(g))
            && (self.c == Storage::F32 || f16_c_suits(g))
    }

    /// The pipeline key's suffix.
    fn key(&self) -> String {
        let ab = match (self.a, self.b) {
            (Storage::F32, Storage::F32) => "",
            (Storage::F16, Storage::F16) => "_f16in",
            (Storage::F16, Storage::F32) => "_f16a",
            (Storage::F32, Storage::F16) => "_f16b",
        };
        let c = if self.c == Storage::F16 { "_c16" } else { "" };
        format!("{ab}{c}")
    }
}

/// What the tensor-core training kernel does with C's values on their way out, beside storing them:
/// an element-wise step fused into the product (one pass over C instead of a kernel that reads it
/// back), through a fourth operand E laid out as C (C's leading dimension, from E's own offset).
/// Each lane takes two neighbouring columns, so n, ldc and both offsets are even, beta is 0 and the
/// product is unbatched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// C alone.
    None,
    /// C (f32) holds the pre-activations, and E receives GELU of them as f16 pairs (gelu_fns.wgsl,
    /// rounded as [`super::pack_f16`] rounds): the MLP's c_fc product and its activation.
    Gelu,
    /// E holds the pre-activations (f32, read), and C (f16 pairs) receives the product times GELU's
    /// derivative at them: the gradient at c_fc's output from mlp_proj's dX product.
    GeluGrad,
    /// C (f32) = E + dropout(product), E the residual stream (f32, read): a projection's branch
    /// joining the residual, with dropout's mask of C's element index (dropout.wgsl's, as
    /// [`crate::ops::dropout::dropout_add`] draws it over C's m · n elements; C dense).
    DropoutAdd,
}

/// An epilogue with its operand: E's tensor, E's offset counted as the kernel indexes it (f16 values
/// where E holds pairs), and for [`Epilogue::DropoutAdd`] dropout's threshold, seed and scale (its
/// bits); zeros elsewhere.
#[derive(Clone, Copy)]
pub(super) struct EpilogueArgs<'a> {
    pub epi: Epilogue,
    pub e: &'a GpuTensor,
    pub offset: usize,
    pub dropout: [u32; 3],
}

impl Epilogue {
    /// The pipeline key's suffix.
    fn key(&self) -> &'static str {
        match self {
            Epilogue::None => "",
            Epilogue::Gelu => "_gelu",
            Epilogue::GeluGrad => "_gelugrad",
            Epilogue::DropoutAdd => "_dropadd",
        }
    }

    /// How C is stored with this epilogue (None: either).
    fn c_storage(&self) -> Option<Storage> {
        match self {
            Epilogue::None => None,
            Epilogue::Gelu | Epilogue::DropoutAdd => Some(Storage::F32),
            Epilogue::GeluGrad => Some(Storage::F16),
        }
    }

    /// Whether E holds f16 pairs (else f32).
    pub(super) fn e_pairs(&self) -> bool {
        *self == Epilogue::Gelu
    }
}

impl EpilogueArgs<'_> {
    /// Whether the kernel takes this epilogue on `g` with C stored as `c` from element `oc` (see
    /// [`Epilogue`]): unbatched, beta 0, even n, ldc and offsets, E in one buffer, and C stored as
    /// the epilogue writes it.
    pub(super) fn fits(&self, g: &Gemm, oc: usize, c: Storage) -> bool {
        g.batches() == 1
            && g.beta == 0.0
            && g.n.is_multiple_of(2)
            && g.ldc.is_multiple_of(2)
            && self.e.num_chunks() == 1
            && self.offset.is_multiple_of(2)
            && oc.is_multiple_of(2)
            && self.epi.c_storage() == Some(c)
    }
}

/// Whether the mixed-precision tensor-core kernel can take a product: f32 operands in one buffer each,
/// any layout, batched.
pub(super) fn mixed_suits(g: &Gemm) -> bool {
    g.m >= 16 && g.n >= 16 && g.k >= 16
}

/// The mixed-precision product on the tensor cores, for training: f32 operands in any layout (a
/// two-level batch of strided matrices), each rounded to f16 as it is staged into workgroup memory,
/// multiplied on 16x16x16 fragments into f32 accumulators; C = alpha · op(A) op(B) + beta · C in f32.
///
/// A workgroup of `sgm` x `sgn` 32-lane subgroups computes a `tm` x `tn` tile of C, each subgroup an
/// equal block of 16x16 fragments. Each k-step stages `bk` columns of op(A) and `bk` rows of op(B):
/// both operands are stored in workgroup memory in the layout their global rows arrive in (so global
/// reads are coalesced and writes to workgroup memory fall on distinct banks), padded to break bank
/// conflicts (each thread stores pairs of consecutive values, [`RUN`]), and loaded into fragments row-
/// or column-major to match. With `prefetch` the next k-step's global loads are issued before the
/// current one is multiplied (register double-buffering).
pub(super) fn mixed_source(
    cfg: MixedTile,
    trans_a: bool,
    trans_b: bool,
    causal: Causal,
    operands: Operands,
    epi: Epilogue,
    fault: Option<Fault>,
) -> String {
    let MixedTile {
        tm,
        tn,
        sgm,
        sgn,
        bk,
        ..
    } = cfg;
    let nt = cfg.threads();
    let (wm, wn) = (tm / sgm, tn / sgn); // each subgroup's block of C
    let (nfa, nfb) = (wm / 16, wn / 16); // its fragments along m and n
    // Padded strides (f16 elements): a tile stored with k contiguous has rows of bk + 8, one stored
    // with m (or n) contiguous has rows of tm (or tn) + 8.
    let ks = bk + 8;
    let (msa, msb) = (tm + 8, tn + 8);
    let (per_a, per_b) = (tm * bk / nt, tn * bk / nt); // elements each thread stages per k-step
    let acc = if fault == Some(Fault::F16Accumulation) {
        "f16"
    } else {
        "f32"
    };
    let c_pairs = operands.c == Storage::F16;
    let direct = cfg.direct_store && acc == "f32" && !c_pairs && epi == Epilogue::None;
    // How a lane of the two-columns-a-lane store (C as pairs, or an epilogue) stores `v`, the values
    // at C's elements ci and ci + 1 (E's at ei and ei + 1).
    let pair_store = match epi {
        Epilogue::None => "mat_c[ci / 2u] = pack2x16float(v);".to_string(),
        Epilogue::Gelu => {
            "mat_c[ci] = v.x;\n      mat_c[ci + 1u] = v.y;\n      mat_e[ei / 2u] = pack2x16float(gelu_of(v));"
                .to_string()
        }
        // `ev`: E's two values, loaded ahead (below).
        Epilogue::GeluGrad => "mat_c[ci / 2u] = pack2x16float(gelu_grad_of(ev, v));".to_string(),
        // dropout.wgsl's expressions, the element index r · n + c of a dense C.
        Epilogue::DropoutAdd => "let i0 = r * p.n + c;
      let keep0 = hash(i0 ^ hs) >= p.d_threshold;
      let keep1 = hash((i0 + 1u) ^ hs) >= p.d_threshold;
      mat_c[ci] = select(0.0, v.x * p.d_scale, keep0) + ev.x;
      mat_c[ci + 1u] = select(0.0, v.y * p.d_scale, keep1) + ev.y;"
            .to_string(),
    };
    let two_columns = c_pairs || epi != Epilogue::None;
    // Epilogues that read E load every value a lane will combine, for all its fragments, before the
    // first fragment is stored: one memory latency a workgroup instead of one a fragment between
    // the stores' barriers (H100: mlp_proj's dX product with GELU's backward 397 µs with the loads
    // in the store loop, against 190 µs for the product alone).
    let e_reads = matches!(epi, Epilogue::GeluGrad | Epilogue::DropoutAdd);
    let mut e_loads = if epi == Epilogue::DropoutAdd {
        "  let hs = hash(p.d_seed);\n".to_string()
    } else {
        String::new()
    };
    // Staging of one operand's values per thread: `v` names their row of op(A) (`r`) or column
    // of op(B) (`c`) within the tile. With k contiguous in memory (op(A) = A stored M x K, op(B) = Bᵀ
    // stored N x K) consecutive threads take consecutive pairs of k and the tile is stored in rows of
    // k; otherwise consecutive threads take consecutive pairs of m (or n) and the tile is stored in
    // rows of m. Each pair is stored as one vec2<f16> ([`RUN`]).
    struct Operand<'a> {
        mat: &'a str,
        reg: &'a str,
        tile: &'a str,
        v: &'a str,
        base: &'a str,
        ld: &'a str,
        origin: &'a str,
        extent: &'a str,
        k_contiguous: bool,
        width: usize,
        ms: usize,
        per: usize,
        f16: bool,
    }
    // Loads into registers (checked: zero outside the matrices) and stores into workgroup memory.
    let staging = |o: &Operand, checked: bool| -> (String, String) {
        let (mut loads, mut stores) = (String::new(), String::new());
        let Operand {
            mat,
            reg,
            tile,
            v,
            base,
            ld,
            origin,
            extent,
            ..
        } = *o;
        debug_assert!([o.per, o.width, bk].iter().all(|v| v.is_multiple_of(RUN)));
        // Run ci of this thread: the pair of values at (v, kk) and the next along the stored rows.
        for ci in 0..o.per / RUN {
            let c = format!("({ci}u * {nt}u + lid)");
            let (vi, ki, slot) = if o.k_contiguous {
                let runs = bk / RUN;
                (
                    format!("({c} / {runs}u)"),
                    format!("(({c} % {runs}u) * {RUN}u)"),
                    format!("{v} * {}u + kk / {RUN}u", ks / RUN),
                )
            } else {
                let runs = o.width / RUN;
                (
                    format!("(({c} % {runs}u) * {RUN}u)"),
                    format!("({c} / {runs}u)"),
                    format!("kk * {}u + {v} / {RUN}u", o.ms / RUN),
                )
            };
            // The run's loads into registers: one word holding both f16 values (every extent,
            // offset and stride even), or RUN f32 values; register i holds element j of the run.
            let run_loads: Vec<(usize, usize)> = if o.f16 {
                vec![(ci, 0)]
            } else {
                (0..RUN).map(|j| (ci * RUN + j, j)).collect()
            };
            let mut body = String::new();
            for (i, j) in run_loads {
                let (idx, inside) = if o.k_contiguous {
                    (
                        format!("{base} + ({origin} + {v}) * p.{ld} + k0 + kk + {j}u"),
                        format!("{origin} + {v} < p.{extent} && k0 + kk + {j}u < p.k"),
                    )
                } else {
                    (
                        format!("{base} + (k0 + kk) * p.{ld} + {origin} + {v} + {j}u"),
                        format!("{origin} + {v} + {j}u < p.{extent} && k0 + kk < p.k"),
                    )
                };
                let (zero, value) = if o.f16 {
                    ("0u", format!("{mat}[({idx}) >> 1u]"))
                } else {
                    ("0.0", format!("{mat}[{idx}]"))
                };
                if checked {
                    body.push_str(&format!(
                        "\n      {reg}[{i}] = {zero}; if ({inside}) {{ {reg}[{i}] = {value}; }}"
                    ));
                } else {
                    body.push_str(&format!("\n      {reg}[{i}] = {value};"));
                }
            }
            loads.push_str(&format!(
                "    {{ let {v} = {vi}; let kk = {ki};{body}\n    }}\n"
            ));
            let val = if o.f16 {
                format!("vec2<f16>(unpack2x16float({reg}[{ci}]))")
            } else {
                let vals: Vec<String> = (0..RUN)
                    .map(|j| format!("f16({reg}[{}])", ci * RUN + j))
                    .collect();
                format!("vec{RUN}<f16>({})", vals.join(", "))
            };
            stores.push_str(&format!(
                "    {{ let {v} = {vi}; let kk = {ki}; {tile}[{slot}] = {val}; }}\n"
            ));
        }
        (loads, stores)
    };
    let a = Operand {
        mat: "mat_a",
        reg: "ra",
        tile: "As",
        v: "r",
        base: "a_base",
        ld: "lda",
        origin: "row0",
        extent: "m",
        k_contiguous: !trans_a,
        width: tm,
        ms: msa,
        per: per_a,
        f16: operands.a == Storage::F16,
    };
    let b = Operand {
        mat: "mat_b",
        reg: "rb",
        tile: "Bs",
        v: "c",
        base: "b_base",
        ld: "ldb",
        origin: "col0",
        extent: "n",
        k_contiguous: trans_b,
        width: tn,
        ms: msb,
        per: per_b,
        f16: operands.b == Storage::F16,
    };
    let mut loads = String::new();
    let mut stores = String::new();
    for (o, full) in [(&a, "full_a"), (&b, "full_b")] {
        let (checked, st) = staging(o, true);
        stores.push_str(&st);
        if cfg.unchecked {
            let (plain, _) = staging(o, false);
            loads.push_str(&format!(
                "    if ({full} && k0 + {bk}u <= p.k) {{\n{plain}    }} else {{\n{checked}    }}\n"
            ));
        } else {
            loads.push_str(&checked);
        }
    }
    // Fragment loads: A fragment fi covers rows fm + 16 fi, B fragment fj columns fn0 + 16 fj.
    let mut frags = String::new();
    for fi in 0..nfa {
        let (ptr, stride, f) = if trans_a {
            (
                format!("kk * {msa}u + fm + {}u", 16 * fi),
                "sma",
                "coopLoad",
            )
        } else {
            (
                format!("(fm + {}u) * {ks}u + kk", 16 * fi),
                "sk",
                "coopLoadT",
            )
        };
        frags.push_str(&format!(
            "      let ia{fi} = {ptr};\n      let a{fi} = {f}<coop_mat16x16<f16, A>>(&As[ia{fi} / {RUN}u], {stride});\n"
        ));
    }
    for fj in 0..nfb {
        let (ptr, stride, f) = if trans_b {
            (
                format!("(fn0 + {}u) * {ks}u + kk", 16 * fj),
                "sk",
                "coopLoad",
            )
        } else {
            (
                format!("kk * {msb}u + fn0 + {}u", 16 * fj),
                "smb",
                "coopLoadT",
            )
        };
        frags.push_str(&format!(
            "      let ib{fj} = {ptr};\n      let b{fj} = {f}<coop_mat16x16<f16, B>>(&Bs[ib{fj} / {RUN}u], {stride});\n"
        ));
    }
    for fi in 0..nfa {
        for fj in 0..nfb {
            frags.push_str(&format!(
                "      c{fi}_{fj} = coopMultiplyAdd(a{fi}, b{fj}, c{fi}_{fj});\n"
            ));
        }
    }
    let mut decl = String::new();
    let mut staged = String::new();
    let mut straight = String::new();
    for fi in 0..nfa {
        for fj in 0..nfb {
            decl.push_str(&format!("  var c{fi}_{fj} = coop_mat16x16<{acc}, C>();\n"));
            // C as f16 pairs, or an epilogue: two neighbouring columns a lane (n, ldc, c_base
            // even; beta 0). Where the epilogue reads E, the four steps are unrolled, each with its
            // values of E loaded ahead into `ev{fi}_{fj}_{j}`.
            let (r0, c0) = (16 * fi, 16 * fj);
            let place = |j: &str| {
                format!(
                    "let e = {j} * 64u + 2u * lane;
    let r = row0 + fm + {r0}u + e / 16u;
    let c = col0 + fn0 + {c0}u + e % 16u;"
                )
            };
            let store = |ev: &str| {
                format!(
                    "    if (r < p.m && c < p.n) {{
      let ci = c_base + r * p.ldc + c;{ev}
      let v = vec2<f32>(p.alpha * f32(Cs[cbase + e]), p.alpha * f32(Cs[cbase + e + 1u]));
      {pair_store}
    }}
"
                )
            };
            let steps = if e_reads {
                (0..4)
                    .map(|j| {
                        let ev = format!("ev{fi}_{fj}_{j}");
                        e_loads.push_str(&format!(
                            "  var {ev} = vec2<f32>(0.0);
  {{
    {}
    if (r < p.m && c < p.n) {{
      let ei = p.e_off + r * p.ldc + c;
      {ev} = vec2<f32>(mat_e[ei], mat_e[ei + 1u]);
    }}
  }}
",
                            place(&format!("{j}u"))
                        ));
                        format!(
                            "  {{
    {}
{}  }}
",
                            place(&format!("{j}u")),
                            store(&format!("\n      let ev = {ev};"))
                        )
                    })
                    .collect::<String>()
            } else {
                let ei = match epi {
                    Epilogue::None => "",
                    _ => "\n      let ei = p.e_off + r * p.ldc + c;",
                };
                format!(
                    "  for (var j = 0u; j < 4u; j = j + 1u) {{
    {}
{}  }}
",
                    place("j"),
                    store(ei)
                )
            };
            let pairs_loop = format!(
                "  coopStoreT(c{fi}_{fj}, &Cs[cbase], s16);
  workgroupBarrier();
{steps}  workgroupBarrier();
"
            );
            if two_columns {
                staged.push_str(&pairs_loop);
                continue;
            }
            staged.push_str(&format!(
                "  coopStoreT(c{fi}_{fj}, &Cs[cbase], s16);
  workgroupBarrier();
  for (var j = 0u; j < 8u; j = j + 1u) {{
    let e = j * 32u + lane;
    let r = row0 + fm + {}u + e / 16u;
    let c = col0 + fn0 + {}u + e % 16u;
    if (r < p.m && c < p.n) {{
      let ci = c_base + r * p.ldc + c;
      var v = p.alpha * f32(Cs[cbase + e]);
      if (p.beta != 0.0) {{ v = v + p.beta * mat_c[ci]; }}
      mat_c[ci] = v;
    }}
  }}
  workgroupBarrier();
",
                16 * fi,
                16 * fj
            ));
            straight.push_str(&format!(
                "    {{ let ic = c_base + (row0 + fm + {}u) * p.ldc + col0 + fn0 + {}u;
      coopStoreT(p.alpha * c{fi}_{fj}, &mat_c[ic], ldc); }}\n",
                16 * fi,
                16 * fj
            ));
        }
    }
    let staged = e_loads + &staged;
    let out = if direct {
        format!(
            "  let ldc = p.ldc;
  if (row0 + {tm}u <= p.m && col0 + {tn}u <= p.n && p.beta == 0.0) {{
{straight}  }} else {{
{staged}  }}"
        )
    } else {
        staged
    };
    let tail = match (fault, c_pairs) {
        (Some(Fault::OutOfBoundsWrite), false) => {
            "  if (lid == 0u && wid.x == 0u && wid.y == 0u && wid.z == 0u) { mat_c[c_base + p.m * p.ldc] = 1.0; }"
        }
        (Some(Fault::NanOutput), false) => {
            "  if (lid == 0u && wid.x == 0u && wid.y == 0u && wid.z == 0u) { mat_c[c_base] = bitcast<f32>(0x7fc00000u); }"
        }
        (Some(Fault::OutOfBoundsWrite), true) => {
            "  if (lid == 0u && wid.x == 0u && wid.y == 0u && wid.z == 0u) { mat_c[(c_base + p.m * p.ldc) / 2u] = 0x3c003c00u; }"
        }
        (Some(Fault::NanOutput), true) => {
            "  if (lid == 0u && wid.x == 0u && wid.y == 0u && wid.z == 0u) { mat_c[c_base / 2u] = 0x7e007e00u; }"
        }
        _ => "",
    };
    let elem_c = if c_pairs { "u32" } else { "f32" };
    let shared_a = if trans_a { bk * msa } else { tm * ks };
    let shared_b = if trans_b { tn * ks } else { bk * msb };
    let cs = nt / 32 * 256;
    // The tiles and their strides in pairs (every stride, tile width and fragment origin is even).
    let (shared_a, shared_b) = (shared_a.div_ceil(RUN), shared_b.div_ceil(RUN));
    let (ks_run, msa_run, msb_run) = (ks / RUN, msa / RUN, msb / RUN);
    let prologue = causal_prologue(causal, tm);
    // Each operand's elements and staging registers: words of f16 pairs, or f32 values.
    let (elem_a, reg_a) = if a.f16 {
        ("u32", per_a / RUN)
    } else {
        ("f32", per_a)
    };
    let (elem_b, reg_b) = if b.f16 {
        ("u32", per_b / RUN)
    } else {
        ("f32", per_b)
    };
    let main_loop = if cfg.prefetch {
        format!(
            "  {{
    let k0 = kb;
{loads}
  }}
  for (var k0 = kb; k0 < ke; k0 = k0 + {bk}u) {{
{stores}
    workgroupBarrier();
    if (k0 + {bk}u < ke) {{
      let k0 = k0 + {bk}u;
{loads}
    }}
    for (var kk = 0u; kk < {bk}u; kk = kk + 16u) {{
{frags}
    }}
    workgroupBarrier();
  }}"
        )
    } else {
        format!(
            "  for (var k0 = kb; k0 < ke; k0 = k0 + {bk}u) {{
{loads}
{stores}
    workgroupBarrier();
    for (var kk = 0u; kk < {bk}u; kk = kk + 16u) {{
{frags}
    }}
    workgroupBarrier();
  }}"
        )
    };
    // An epilogue's operand E (binding 4), E's offset after the products' parameters, and its
    // element-wise functions.
    let (params, e_binding) = match epi {
        Epilogue::None => (PARAMS.to_string(), String::new()),
        _ => {
            let with_e = PARAMS.replace(
                "alpha: f32, beta: f32,",
                "alpha: f32, beta: f32,\n  e_off: u32, d_threshold: u32, d_seed: u32, d_scale: f32,",
            );
            debug_assert_ne!(with_e, PARAMS);
            let (e, fns) = match epi {
                Epilogue::Gelu => (
                    "read_write> mat_e: array<u32>",
                    crate::ops::gelu::wgsl_fns("vec2<f32>"),
                ),
                Epilogue::GeluGrad => (
                    "read> mat_e: array<f32>",
                    crate::ops::gelu::wgsl_fns("vec2<f32>"),
                ),
                _ => (
                    "read> mat_e: array<f32>",
                    crate::ops::dropout::HASH_WGSL.to_string(),
                ),
            };
            (
                with_e,
                format!("@group(0) @binding(4) var<storage, {e};\n{fns}"),
            )
        }
    };
    format!(
        "enable f16;
enable wgpu_cooperative_matrix;
{params}@group(0) @binding(1) var<storage, read> mat_a: array<{elem_a}>;
@group(0) @binding(2) var<storage, read> mat_b: array<{elem_b}>;
@group(0) @binding(3) var<storage, read_write> mat_c: array<{elem_c}>;
{e_binding}
var<workgroup> As: array<vec{RUN}<f16>, {shared_a}>;
var<workgroup> Bs: array<vec{RUN}<f16>, {shared_b}>;
var<workgroup> Cs: array<{acc}, {cs}>; // one 16x16 fragment per subgroup

@compute @workgroup_size({nt})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let z1 = wid.z / p.b2;
  let z2 = wid.z % p.b2;
  let a_base = p.a_off + z1 * p.sa1 + z2 * p.sa2;
  let b_base = p.b_off + z1 * p.sb1 + z2 * p.sb2;
  let c_base = p.c_off + z1 * p.sc1 + z2 * p.sc2;
  let row0 = wid.y * {tm}u;
  let col0 = wid.x * {tn}u;
{prologue}  let full_a = row0 + {tm}u <= p.m;
  let full_b = col0 + {tn}u <= p.n;
  let sg = lid / 32u;
  let fm = (sg / {sgn}u) * {wm}u;
  let fn0 = (sg % {sgn}u) * {wn}u;
  let sk = {ks_run}u;
  let sma = {msa_run}u;
  let smb = {msb_run}u;
{decl}
  var ra: array<{elem_a}, {reg_a}>;
  var rb: array<{elem_b}, {reg_b}>;
{main_loop}
  let lane = lid % 32u;
  let cbase = sg * 256u;
  let s16 = 16u;
{out}
{tail}
}}
"
    )
}

/// Whether the tensor-core kernel takes the product's layout with [`Operands::F16`] (each staged
/// pair of values one word): even extents, leading dimensions and batch strides of A and B.
pub fn f16_operands_suit(g: &Gemm) -> bool {
    f16_a_suits(g) && f16_b_suits(g)
}

/// [`f16_operands_suit`] for A alone: even m, k, lda and batch strides of A.
pub(super) fn f16_a_suits(g: &Gemm) -> bool {
    [g.m, g.k, g.lda, g.stride_a[0], g.stride_a[1]]
        .iter()
        .all(|v| v % 2 == 0)
}

/// Whether C can be written as f16 pairs: even n, ldc and batch strides of C, and beta = 0.
pub(super) fn f16_c_suits(g: &Gemm) -> bool {
    g.beta == 0.0
        && [g.n, g.ldc, g.stride_c[0], g.stride_c[1]]
            .iter()
            .all(|v| v % 2 == 0)
}

/// [`f16_operands_suit`] for B alone: even n, k, ldb and batch strides of B.
pub(super) fn f16_b_suits(g: &Gemm) -> bool {
    [g.n, g.k, g.ldb, g.stride_b[0], g.stride_b[1]]
        .iter()
        .all(|v| v % 2 == 0)
}

/// C = alpha · op(A) op(B) + beta · C on the tensor cores with f16-rounded operands (see
/// [`mixed_source`]), on the workgroup tile `tile`; every operand in one buffer.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul_coop_mixed(
    gb: &GpuBackend,
    a: (&GpuTensor, usize),
    b: (&GpuTensor, usize),
    c: (&GpuTensor, usize),
    g: &Gemm,
    tile: MixedTile,
    operands: Operands,
    fault: Option<Fault>,
) -> Result<()> {
    matmul_coop_epilogue(gb, a, b, c, None, g, tile, operands, fault)
}

/// [`matmul_coop_mixed`] with an [`Epilogue`] on its operand E; `None`: C alone.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul_coop_epilogue(
    gb: &GpuBackend,
    (ta, oa): (&GpuTensor, usize),
    (tb, ob): (&GpuTensor, usize),
    (tc, oc): (&GpuTensor, usize),
    e: Option<EpilogueArgs<'_>>,
    g: &Gemm,
    tile: MixedTile,
    operands: Operands,
    fault: Option<Fault>,
) -> Result<()> {
    let epi = e.map_or(Epilogue::None, |e| e.epi);
    if !e.is_none_or(|e| e.fits(g, oc, operands.c)) {
        return Err(Error::Shape {
            op: "matmul_coop_mixed",
            msg:
                "an epilogue takes an unbatched product with beta 0, even n, ldc and offsets, E in \
                  one buffer, and C stored as the epilogue writes it"
                    .into(),
        });
    }
    if ta.num_chunks() != 1 || tb.num_chunks() != 1 || tc.num_chunks() != 1 {
        return Err(Error::Shape {
            op: "matmul_coop_mixed",
            msg: "the mixed-precision tensor-core kernel takes every operand in one buffer".into(),
        });
    }
    let even_offsets = [(operands.a, oa), (operands.b, ob), (operands.c, oc)]
        .iter()
        .all(|&(s, o)| s == Storage::F32 || o % 2 == 0);
    if !(operands.suit(g) && even_offsets) {
        return Err(Error::Shape {
            op: "matmul_coop_mixed",
            msg: "f16 operands need even extents, offsets, leading dimensions and batch strides \
                  (and an f16 C beta = 0)"
                .into(),
        });
    }
    if g.m == 0 || g.n == 0 || g.batches() == 0 {
        return Ok(());
    }
    let (trans_a, trans_b) = (g.trans_a, g.trans_b);
    let causal = g.causal;
    let key = format!(
        "gemm_coop_mixed_{}{}_{}{}{}{}{}",
        if trans_a { 't' } else { 'n' },
        if trans_b { 't' } else { 'n' },
        tile.key(),
        causal_key(causal),
        operands.key(),
        epi.key(),
        fault.map_or(String::new(), |f| format!("_fault{f:?}"))
    );
    let mut access = vec![Access::Read, Access::Read, Access::ReadWrite];
    let mut p = super::params(g, [oa, ob, oc], g.m, g.n, g.k, g.beta);
    let mut bufs = vec![
        &ta.chunks[0].buffer,
        &tb.chunks[0].buffer,
        &tc.chunks[0].buffer,
    ];
    if let Some(e) = e {
        access.push(match e.epi {
            Epilogue::Gelu => Access::ReadWrite,
            _ => Access::Read,
        });
        p.push(e.offset as u32);
        p.extend(e.dropout);
        bufs.push(&e.e.chunks[0].buffer);
    }
    let pipe = gb.pipeline(&key, &access, || {
        mixed_source(tile, trans_a, trans_b, causal, operands, epi, fault)
    })?;
    gb.dispatch(
        &pipe,
        &p,
        &bufs,
        [
            g.n.div_ceil(tile.tn) as u32,
            g.m.div_ceil(tile.tm) as u32,
            g.batches() as u32,
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pairing of the operands' storage.
    fn every_storage() -> [Operands; 4] {
        let (f32, f16) = (Storage::F32, Storage::F16);
        [(f32, f32), (f16, f16), (f16, f32), (f32, f16)].map(|(a, b)| Operands::of(a, b))
    }

    /// The generated kernels are valid WGSL for naga's front end and validator, at every tile shape
    /// (the tensor-core path itself only runs where the adapter has cooperative matrices; its gate
    /// then decides).
    #[test]
    fn cooperative_kernel_parses_and_validates() {
        let faults = [
            None,
            Some(Fault::OutOfBoundsWrite),
            Some(Fault::NanOutput),
            Some(Fault::F16Accumulation),
        ];
        let mixed = MixedTile::CANDIDATES.into_iter().flat_map(|tile| {
            faults.into_iter().flat_map(move |f| {
                every_storage().into_iter().flat_map(move |o| {
                    [Storage::F32, Storage::F16].into_iter().flat_map(move |c| {
                        let o = Operands { c, ..o };
                        [(false, false), (false, true), (true, false), (true, true)].map(
                            |(ta, tb)| {
                                mixed_source(tile, ta, tb, Causal::None, o, Epilogue::None, f)
                            },
                        )
                    })
                })
            })
        });
        let causal = [Causal::Output, Causal::ALower, Causal::AUpper]
            .into_iter()
            .flat_map(|c| {
                let pairs_out = Operands {
                    c: Storage::F16,
                    ..Operands::of(Storage::F16, Storage::F32)
                };
                [(false, false), (true, false)]
                    .into_iter()
                    .flat_map(move |(ta, tb)| {
                        [Operands::F32, pairs_out].map(|o| {
                            mixed_source(MixedTile::SMALL, ta, tb, c, o, Epilogue::None, None)
                        })
                    })
            });
        // The epilogues, on the training path's tiles and both products they end (x·Wᵀ with
        // f16 weights, dY·W), with and without the faults a gate plants.
        let epilogues = mixed_tiles_of_any_adapter().into_iter().flat_map(|tile| {
            faults.into_iter().flat_map(move |f| {
                [
                    (Epilogue::Gelu, Storage::F32),
                    (Epilogue::GeluGrad, Storage::F16),
                    (Epilogue::DropoutAdd, Storage::F32),
                ]
                .into_iter()
                .flat_map(move |(epi, c)| {
                    let o = Operands { c, ..Operands::F16 };
                    [(false, true), (false, false)]
                        .map(|(ta, tb)| mixed_source(tile, ta, tb, Causal::None, o, epi, f))
                })
            })
        });
        for src in faults[..3]
            .iter()
            .map(|&f| source(f))
            .chain(mixed)
            .chain(causal)
            .chain(epilogues)
        {
            let module = naga::front::wgsl::parse_str(&src)
                .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
            let mut v = naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            );
            v.validate(&module).unwrap_or_else(|e| panic!("{e:?}"));
        }
    }

    /// The tiles [`mixed_tile`] chooses from on one adapter or another.
    fn mixed_tiles_of_any_adapter() -> [MixedTile; 3] {
        [MixedTile::LARGE, MixedTile::LARGE_K32, MixedTile::SMALL]
    }

    /// Every tile shape declares no more workgroup memory than `shared_bytes` says (what the choice
    /// of tile checks against the adapter's limit), and LARGE fits the 48 KiB most desktop GPUs give.
    #[test]
    fn tiles_declare_what_shared_bytes_says() {
        for tile in MixedTile::CANDIDATES {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for o in every_storage() {
                    let src = mixed_source(tile, ta, tb, Causal::None, o, Epilogue::None, None);
                    let module = naga::front::wgsl::parse_str(&src).unwrap();
                    let declared: u32 = module
                        .global_variables
                        .iter()
                        .filter(|(_, v)| v.space == naga::AddressSpace::WorkGroup)
                        .map(|(_, v)| module.types[v.ty].inner.size(module.to_ctx()))
                        .sum();
                    assert!(
                        declared as usize <= tile.shared_bytes(),
                        "{} declares {declared} bytes",
                        tile.key()
                    );
                }
            }
        }
        assert!(MixedTile::LARGE.shared_bytes() <= 48 << 10);
        assert!(MixedTile::SMALL.shared_bytes() <= 16 << 10);
    }
}
