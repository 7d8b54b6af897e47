//! The cooperative-matrix fast path: x · Wᵀ on the tensor cores through wgpu's experimental
//! cooperative-matrix extension — f16 inputs, f32 accumulation, 16x16x16 fragments.
//!
//! A workgroup of four 32-lane subgroups computes a 64x64 tile of C, each subgroup a 32x32 quarter as
//! 2x2 fragments. Tiles of x (f32, rounded to f16) and W (f16-packed) are staged through workgroup
//! memory: naga 30's SPIR-V writer panics on cooperative loads from storage arrays at runtime indices,
//! but loads from workgroup arrays work. Every index and stride is a `let` of its own for the same
//! reason. The pipeline is built where a panic becomes a failed gate ([`crate::gpu`]'s pipeline builder
//! catches it), never a crashed program.

use super::Gemm;
use super::tiled::PARAMS;
use crate::error::{Error, Result};
use crate::gpu::{Access, GpuBackend, GpuTensor, PipelineOptions};
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
        PipelineOptions::default(),
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

/// Output tile of the mixed-precision kernel (rows and columns); its k-step is [`MIXED_BK`].
pub(super) const MIXED_TILE: usize = 128;
const MIXED_BK: usize = 32;

/// Whether the mixed-precision tensor-core kernel can take a product: f32 operands in one buffer each,
/// any layout, batched.
pub(super) fn mixed_suits(g: &Gemm) -> bool {
    g.m >= 16 && g.n >= 16 && g.k >= 16
}

/// The mixed-precision product on the tensor cores, for training: f32 operands in any layout (a
/// two-level batch of strided matrices), each rounded to f16 as it is staged into workgroup memory,
/// multiplied on 16x16x16 fragments into f32 accumulators; C = alpha · op(A) op(B) + beta · C in f32.
///
/// A workgroup of eight 32-lane subgroups computes a 128x128 tile of C, each subgroup a 64x32 block as
/// 4x2 fragments. Each k-step stages 32 columns of op(A) and 32 rows of op(B): both operands are
/// stored in workgroup memory in the layout their global rows arrive in (so global reads are coalesced
/// and writes to workgroup memory fall on distinct banks), padded to break bank conflicts, and loaded
/// into fragments row- or column-major to match. The next k-step's global loads are issued before the
/// current one is multiplied (register double-buffering).
fn mixed_source(trans_a: bool, trans_b: bool, fault: Option<Fault>) -> String {
    const NT: usize = 256;
    // Padded strides (f16 elements): a tile stored with k contiguous has rows of BK + 8, one stored with
    // m (or n) contiguous has rows of 128 + 8.
    let (ks, ms) = (MIXED_BK + 8, MIXED_TILE + 8);
    let per = MIXED_TILE * MIXED_BK / NT; // elements of each operand one thread stages per k-step
    let acc = if fault == Some(Fault::F16Accumulation) {
        "f16"
    } else {
        "f32"
    };
    // Staging of one operand's i-th element per thread: `v` names its row of op(A) (`r`) or column
    // of op(B) (`c`) within the tile. With k contiguous in memory (op(A) = A stored M x K, op(B) = Bᵀ
    // stored N x K) consecutive threads take consecutive k and the tile is stored in rows of k;
    // otherwise consecutive threads take consecutive m (or n) and the tile is stored in rows of m.
    let stage = |i: usize,
                 k_contiguous: bool,
                 (mat, reg, tile, v): (&str, &str, &str, &str),
                 (base, ld, origin, extent): (&str, &str, &str, &str)| {
        let (vi, ki, idx, slot) = if k_contiguous {
            (
                format!("(({i}u * 256u + lid) / 32u)"),
                format!("(({i}u * 256u + lid) % 32u)"),
                format!("{base} + ({origin} + {v}) * p.{ld} + k0 + kk"),
                format!("{v} * {ks}u + kk"),
            )
        } else {
            (
                format!("(({i}u * 256u + lid) % 128u)"),
                format!("(({i}u * 256u + lid) / 128u)"),
                format!("{base} + (k0 + kk) * p.{ld} + {origin} + {v}"),
                format!("kk * {ms}u + {v}"),
            )
        };
        (
            format!(
                "    {{ let {v} = {vi}; let kk = {ki}; {reg}[{i}] = 0.0;
      if ({origin} + {v} < p.{extent} && k0 + kk < p.k) {{ {reg}[{i}] = {mat}[{idx}]; }} }}\n"
            ),
            format!("    {{ let {v} = {vi}; let kk = {ki}; {tile}[{slot}] = f16({reg}[{i}]); }}\n"),
        )
    };
    let mut loads = String::new();
    let mut stores = String::new();
    for i in 0..per {
        let a = stage(
            i,
            !trans_a,
            ("mat_a", "ra", "As", "r"),
            ("a_base", "lda", "row0", "m"),
        );
        let b = stage(
            i,
            trans_b,
            ("mat_b", "rb", "Bs", "c"),
            ("b_base", "ldb", "col0", "n"),
        );
        for (l, st) in [a, b] {
            loads.push_str(&l);
            stores.push_str(&st);
        }
    }
    // Fragment loads: A fragment fi covers rows fm + 16 fi, B fragment fj columns fn0 + 16 fj.
    let mut frags = String::new();
    for fi in 0..4 {
        let (ptr, stride, f) = if trans_a {
            (format!("kk * {ms}u + fm + {}u", 16 * fi), "sm", "coopLoad")
        } else {
            (
                format!("(fm + {}u) * {ks}u + kk", 16 * fi),
                "sk",
                "coopLoadT",
            )
        };
        frags.push_str(&format!(
            "      let ia{fi} = {ptr};\n      let a{fi} = {f}<coop_mat16x16<f16, A>>(&As[ia{fi}], {stride});\n"
        ));
    }
    for fj in 0..2 {
        let (ptr, stride, f) = if trans_b {
            (
                format!("(fn0 + {}u) * {ks}u + kk", 16 * fj),
                "sk",
                "coopLoad",
            )
        } else {
            (
                format!("kk * {ms}u + fn0 + {}u", 16 * fj),
                "sm",
                "coopLoadT",
            )
        };
        frags.push_str(&format!(
            "      let ib{fj} = {ptr};\n      let b{fj} = {f}<coop_mat16x16<f16, B>>(&Bs[ib{fj}], {stride});\n"
        ));
    }
    for fi in 0..4 {
        for fj in 0..2 {
            frags.push_str(&format!(
                "      c{fi}{fj} = coopMultiplyAdd(a{fi}, b{fj}, c{fi}{fj});\n"
            ));
        }
    }
    let mut decl = String::new();
    let mut out = String::new();
    for fi in 0..4 {
        for fj in 0..2 {
            decl.push_str(&format!("  var c{fi}{fj} = coop_mat16x16<{acc}, C>();\n"));
            out.push_str(&format!(
                "  coopStoreT(c{fi}{fj}, &Cs[cbase], s16);
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
        }
    }
    let tail = match fault {
        Some(Fault::OutOfBoundsWrite) => {
            "  if (lid == 0u && wid.x == 0u && wid.y == 0u && wid.z == 0u) { mat_c[c_base + p.m * p.ldc] = 1.0; }"
        }
        Some(Fault::NanOutput) => {
            "  if (lid == 0u && wid.x == 0u && wid.y == 0u && wid.z == 0u) { mat_c[c_base] = bitcast<f32>(0x7fc00000u); }"
        }
        _ => "",
    };
    let shared = MIXED_TILE * ks.max(ms * MIXED_BK / MIXED_TILE);
    format!(
        "enable f16;
enable wgpu_cooperative_matrix;
{PARAMS}@group(0) @binding(1) var<storage, read> mat_a: array<f32>;
@group(0) @binding(2) var<storage, read> mat_b: array<f32>;
@group(0) @binding(3) var<storage, read_write> mat_c: array<f32>;

var<workgroup> As: array<f16, {shared}>;
var<workgroup> Bs: array<f16, {shared}>;
var<workgroup> Cs: array<{acc}, 2048>; // one 16x16 fragment per subgroup

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let z1 = wid.z / p.b2;
  let z2 = wid.z % p.b2;
  let a_base = p.a_off + z1 * p.sa1 + z2 * p.sa2;
  let b_base = p.b_off + z1 * p.sb1 + z2 * p.sb2;
  let c_base = p.c_off + z1 * p.sc1 + z2 * p.sc2;
  let row0 = wid.y * 128u;
  let col0 = wid.x * 128u;
  let sg = lid / 32u;
  let fm = (sg / 4u) * 64u;
  let fn0 = (sg % 4u) * 32u;
  let sk = {ks}u;
  let sm = {ms}u;
{decl}
  var ra: array<f32, {per}>;
  var rb: array<f32, {per}>;
  {{
    let k0 = 0u;
{loads}
  }}
  for (var k0 = 0u; k0 < p.k; k0 = k0 + 32u) {{
{stores}
    workgroupBarrier();
    if (k0 + 32u < p.k) {{
      let k0 = k0 + 32u;
{loads}
    }}
    for (var kk = 0u; kk < 32u; kk = kk + 16u) {{
{frags}
    }}
    workgroupBarrier();
  }}
  let lane = lid % 32u;
  let cbase = sg * 256u;
  let s16 = 16u;
{out}
{tail}
}}
"
    )
}

/// C = alpha · op(A) op(B) + beta · C on the tensor cores with f16-rounded operands (see
/// [`mixed_source`]); every operand in one buffer.
pub(super) fn matmul_coop_mixed(
    gb: &GpuBackend,
    (ta, oa): (&GpuTensor, usize),
    (tb, ob): (&GpuTensor, usize),
    (tc, oc): (&GpuTensor, usize),
    g: &Gemm,
    fault: Option<Fault>,
) -> Result<()> {
    if ta.num_chunks() != 1 || tb.num_chunks() != 1 || tc.num_chunks() != 1 {
        return Err(Error::Shape {
            op: "matmul_coop_mixed",
            msg: "the mixed-precision tensor-core kernel takes every operand in one buffer".into(),
        });
    }
    if g.m == 0 || g.n == 0 || g.batches() == 0 {
        return Ok(());
    }
    let (trans_a, trans_b) = (g.trans_a, g.trans_b);
    let key = format!(
        "gemm_coop_mixed_{}{}{}",
        if trans_a { 't' } else { 'n' },
        if trans_b { 't' } else { 'n' },
        fault.map_or(String::new(), |f| format!("_fault{f:?}"))
    );
    let pipe = gb.pipeline(
        &key,
        &[Access::Read, Access::Read, Access::ReadWrite],
        PipelineOptions::default(),
        || mixed_source(trans_a, trans_b, fault),
    )?;
    let p = super::params(g, [oa, ob, oc], g.m, g.n, g.k, g.beta);
    let bufs = [
        &ta.chunks[0].buffer,
        &tb.chunks[0].buffer,
        &tc.chunks[0].buffer,
    ];
    gb.dispatch(
        &pipe,
        &p,
        &bufs,
        [
            g.n.div_ceil(MIXED_TILE) as u32,
            g.m.div_ceil(MIXED_TILE) as u32,
            g.batches() as u32,
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated kernel is valid WGSL for naga's front end and validator (the tensor-core path
    /// itself only runs where the adapter has cooperative matrices; its gate then decides).
    #[test]
    fn cooperative_kernel_parses_and_validates() {
        let faults = [
            None,
            Some(Fault::OutOfBoundsWrite),
            Some(Fault::NanOutput),
            Some(Fault::F16Accumulation),
        ];
        let mixed = faults.iter().flat_map(|&f| {
            [(false, false), (false, true), (true, false), (true, true)]
                .map(|(ta, tb)| mixed_source(ta, tb, f))
        });
        for src in faults[..3].iter().map(|&f| source(f)).chain(mixed) {
            let module = naga::front::wgsl::parse_str(&src)
                .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
            let mut v = naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            );
            v.validate(&module).unwrap_or_else(|e| panic!("{e:?}"));
        }
    }
}
