//! Generates the tiled GEMM kernel's WGSL for one tile configuration and one pair of layouts.
//!
//! The inner loop is written out in full (every k of the tile, every register of the thread's
//! sub-tile) because WGSL has no unroll directive and a register array indexed by a loop counter can
//! end up in local memory on some drivers.
//!
//! Tile of C: BM x BN per workgroup, each thread TM x TN of it, in TM/4 x TN/4 groups of 4x4 spread
//! across the tile (group g of a thread starts at g * BM/(TM/4) + 4 * tr), so that the 4-wide reads of
//! neighbouring threads from workgroup memory fall on neighbouring addresses.
//!
//! Workgroup memory holds the A tile k-major (`As[k][m]`) and the B tile k-major (`Bs[k][n]`) as
//! vec4 rows, so each step of the inner loop is TM/4 + TN/4 vec4 reads for TM x TN fused multiply-adds.
//! Global loads for the next k-tile are issued before the current tile is consumed (register
//! double-buffering) so their latency hides behind the arithmetic.

use std::fmt::Write;

use super::Causal;
use crate::path::Fault;

/// One tile configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub bm: u32,
    pub bn: u32,
    pub bk: u32,
    pub tm: u32,
    pub tn: u32,
}

impl Tile {
    pub const fn threads(&self) -> u32 {
        (self.bm / self.tm) * (self.bn / self.tn)
    }
    /// Workgroup memory the tile needs, in bytes.
    pub const fn shared_bytes(&self) -> u32 {
        // Each k-row of a tile is padded by one vector (see `gemm_source`).
        (self.bm + self.bn + 8) * self.bk * 4
    }
    pub fn key(&self) -> String {
        format!(
            "{}x{}x{}_{}x{}",
            self.bm, self.bn, self.bk, self.tm, self.tn
        )
    }
    /// Whether the tile's shape is one the generator supports.
    pub fn is_valid(&self) -> bool {
        let t = self.threads();
        self.tm.is_multiple_of(4)
            && self.tn.is_multiple_of(4)
            && (self.bm * self.bk).is_multiple_of(t)
            && (self.bn * self.bk).is_multiple_of(t)
            && self.bm.is_multiple_of(self.tm)
            && self.bn.is_multiple_of(self.tn)
    }
}

/// Kernel variants beyond the tile shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GemmOpts {
    pub trans_a: bool,
    pub trans_b: bool,
    /// B holds f16 values packed two per u32 (`pack2x16float`); its offsets, strides and leading
    /// dimension count f16 elements. Accumulation stays f32.
    pub b_f16: bool,
    /// Stage the tiles in workgroup memory as f16 and multiply f16 operands (`enable f16`), adding the
    /// products into f32 accumulators.
    pub shader_f16: bool,
    /// Read the operands straight from storage, without workgroup tiles or barriers: the form for
    /// CPU-type adapters (llvmpipe, SwiftShader), which run a workgroup's invocations as SIMD lanes of
    /// one thread and pay a switch between them at every barrier. Each output sums its products in the
    /// same order with the same fused multiply-adds as the tiled form, so the results are the same.
    pub direct: bool,
    /// Tiles and k-steps the product's causal structure leaves without work are skipped (the tiled
    /// form; the direct form computes everything).
    pub causal: Causal,
}

impl GemmOpts {
    pub fn key(&self) -> String {
        format!(
            "{}{}{}{}{}{}",
            if self.trans_a { 't' } else { 'n' },
            if self.trans_b { 't' } else { 'n' },
            if self.b_f16 { "_bf16" } else { "" },
            if self.shader_f16 { "_sf16" } else { "" },
            if self.direct { "_direct" } else { "" },
            causal_key(self.causal),
        )
    }
}

/// The kernel-key suffix of a causal structure.
pub(super) fn causal_key(c: Causal) -> &'static str {
    match c {
        Causal::None => "",
        Causal::Output => "_cout",
        Causal::ALower => "_clow",
        Causal::AUpper => "_cup",
    }
}

/// WGSL lines that set `kb` and `ke`, the k range a workgroup whose rows start at `row0` sums over
/// (`tm` rows a tile), and return early from a tile with nothing to compute; none of them read or
/// write memory, so a skipping workgroup leaves before any barrier.
pub(super) fn causal_prologue(c: Causal, tm: usize) -> String {
    match c {
        Causal::None => "  let kb = 0u;\n  let ke = p.k;\n".into(),
        Causal::Output => {
            format!("  if (col0 >= row0 + {tm}u) {{ return; }}\n  let kb = 0u;\n  let ke = p.k;\n")
        }
        Causal::ALower => format!("  let kb = 0u;\n  let ke = min(p.k, row0 + {tm}u);\n"),
        Causal::AUpper => "  let kb = min(row0, p.k);\n  let ke = p.k;\n".into(),
    }
}

/// The uniform block every batched GEMM kernel reads (the tiled kernels and the tensor-core training
/// kernel). Keep in sync with [`super::params`].
pub(super) const PARAMS: &str = "struct Params {
  m: u32, n: u32, k: u32,
  lda: u32, ldb: u32, ldc: u32,
  a_off: u32, b_off: u32, c_off: u32,
  b2: u32,
  sa1: u32, sa2: u32, sb1: u32, sb2: u32, sc1: u32, sc2: u32,
  alpha: f32, beta: f32,
}
@group(0) @binding(0) var<uniform> p: Params;
";

/// The tiled kernels' operands.
const BINDINGS: &str = "@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<BT>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;
";

/// WGSL for C = alpha * op(A) op(B) + beta * C with the given tile and transposes (`fault`: a planted
/// fault's broken variant, tests only).
pub fn gemm_source(t: Tile, o: GemmOpts, fault: Option<Fault>) -> String {
    assert!(t.is_valid(), "invalid GEMM tile {t:?}");
    if o.direct && !o.shader_f16 {
        return direct_source(t, o, fault);
    }
    let (trans_a, trans_b) = (o.trans_a, o.trans_b);
    // Element type of the workgroup tiles and of the accumulators (f16 accumulation is a planted fault).
    let st = if o.shader_f16 { "f16" } else { "f32" };
    let acc_t = if fault == Some(Fault::F16Accumulation) {
        "f16"
    } else {
        "f32"
    };
    let nt = t.threads();
    let (gm, gn) = (t.tm / 4, t.tn / 4); // 4-groups per thread in each direction
    let (sm, sn) = (t.bm / gm, t.bn / gn); // distance between a thread's groups
    let a_per = t.bm * t.bk / nt; // A elements each thread loads per k-tile
    let b_per = t.bn * t.bk / nt;
    let mut s = String::new();
    let w = &mut s;
    if o.shader_f16 || acc_t == "f16" {
        let _ = writeln!(w, "enable f16;");
    }
    let _ = writeln!(w, "alias BT = {};", if o.b_f16 { "u32" } else { "f32" });
    let _ = writeln!(w, "alias ST = {st};\nalias AccT = {acc_t};");
    let _ = writeln!(w, "{PARAMS}{BINDINGS}");
    let _ = writeln!(
        w,
        "const BM: u32 = {}u; const BN: u32 = {}u; const BK: u32 = {}u; const NT: u32 = {nt}u;",
        t.bm, t.bn, t.bk
    );
    // A k-row of each tile is BM/4 (BN/4) vectors and one of padding: a tile staged from rows of k
    // (x·Wᵀ's operands) has consecutive threads store consecutive k, one k-row apart, and without the
    // padding those rows start on the same bank.
    let (ra, rb) = (t.bm / 4 + 1, t.bn / 4 + 1);
    let _ = writeln!(w, "const RA: u32 = {ra}u; const RB: u32 = {rb}u;");
    let _ = writeln!(w, "var<workgroup> As: array<vec4<ST>, {}>;", ra * t.bk);
    let _ = writeln!(w, "var<workgroup> Bs: array<vec4<ST>, {}>;", rb * t.bk);
    let _ = writeln!(
        w,
        "@compute @workgroup_size({nt})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let z1 = wid.z / p.b2;
  let z2 = wid.z % p.b2;
  let a_base = p.a_off + z1 * p.sa1 + z2 * p.sa2;
  let b_base = p.b_off + z1 * p.sb1 + z2 * p.sb2;
  let c_base = p.c_off + z1 * p.sc1 + z2 * p.sc2;
  let row0 = wid.y * BM;
  let col0 = wid.x * BN;
  let tr = lid / {tcols}u;
  let tc = lid % {tcols}u;",
        tcols = t.bn / t.tn
    );
    w.push_str(&causal_prologue(o.causal, t.bm as usize));
    // Load coordinates (fixed per thread) for the A and B tiles.
    for i in 0..a_per {
        if trans_a {
            // A stored K x M: consecutive threads take consecutive m.
            let _ = writeln!(
                w,
                "  let la_k{i} = ({i}u * NT + lid) / BM; let la_m{i} = ({i}u * NT + lid) % BM;"
            );
        } else {
            let _ = writeln!(
                w,
                "  let la_m{i} = ({i}u * NT + lid) / BK; let la_k{i} = ({i}u * NT + lid) % BK;"
            );
        }
    }
    for i in 0..b_per {
        if trans_b {
            let _ = writeln!(
                w,
                "  let lb_n{i} = ({i}u * NT + lid) / BK; let lb_k{i} = ({i}u * NT + lid) % BK;"
            );
        } else {
            // B stored K x N: consecutive threads take consecutive n.
            let _ = writeln!(
                w,
                "  let lb_k{i} = ({i}u * NT + lid) / BN; let lb_n{i} = ({i}u * NT + lid) % BN;"
            );
        }
    }
    // Registers for the next tile's global loads.
    let load = |w: &mut String, k0: &str| {
        for i in 0..a_per {
            let idx = if trans_a {
                format!("a_base + ({k0} + la_k{i}) * p.lda + row0 + la_m{i}")
            } else {
                format!("a_base + (row0 + la_m{i}) * p.lda + {k0} + la_k{i}")
            };
            let _ = writeln!(
                w,
                "    ra{i} = 0.0; if (row0 + la_m{i} < p.m && {k0} + la_k{i} < p.k) {{ ra{i} = A[{idx}]; }}"
            );
        }
        for i in 0..b_per {
            let idx = if trans_b {
                format!("b_base + (col0 + lb_n{i}) * p.ldb + {k0} + lb_k{i}")
            } else {
                format!("b_base + ({k0} + lb_k{i}) * p.ldb + col0 + lb_n{i}")
            };
            let load = if o.b_f16 {
                format!("{{ let e = {idx}; rb{i} = unpack2x16float(B[e >> 1u])[e & 1u]; }}")
            } else {
                format!("rb{i} = B[{idx}];")
            };
            let _ = writeln!(
                w,
                "    rb{i} = 0.0; if (col0 + lb_n{i} < p.n && {k0} + lb_k{i} < p.k) {{ {load} }}"
            );
        }
    };
    for i in 0..a_per {
        let _ = writeln!(w, "  var ra{i}: f32;");
    }
    for i in 0..b_per {
        let _ = writeln!(w, "  var rb{i}: f32;");
    }
    for i in 0..t.tm {
        for g in 0..gn {
            let _ = writeln!(w, "  var acc{i}_{g} = vec4<AccT>(0.0);");
        }
    }
    let _ = writeln!(w, "  {{");
    load(w, "kb");
    let _ = writeln!(w, "  }}");
    let _ = writeln!(w, "  for (var k0 = kb; k0 < ke; k0 = k0 + BK) {{");
    let _ = writeln!(w, "    workgroupBarrier();");
    for i in 0..a_per {
        let _ = writeln!(
            w,
            "    As[la_k{i} * RA + la_m{i} / 4u][la_m{i} % 4u] = ST(ra{i});"
        );
    }
    for i in 0..b_per {
        let _ = writeln!(
            w,
            "    Bs[lb_k{i} * RB + lb_n{i} / 4u][lb_n{i} % 4u] = ST(rb{i});"
        );
    }
    let _ = writeln!(w, "    workgroupBarrier();");
    let _ = writeln!(w, "    let kn = k0 + BK;");
    let _ = writeln!(w, "    if (kn < ke) {{");
    load(w, "kn");
    let _ = writeln!(w, "    }}");
    for kk in 0..t.bk {
        for g in 0..gm {
            let _ = writeln!(
                w,
                "    let a{kk}_{g} = As[{} + {}u + tr];",
                kk * ra,
                g * sm / 4
            );
        }
        for g in 0..gn {
            let _ = writeln!(
                w,
                "    let b{kk}_{g} = Bs[{} + {}u + tc];",
                kk * rb,
                g * sn / 4
            );
        }
        for gi in 0..gm {
            for c in 0..4 {
                let i = gi * 4 + c;
                let comp = ["x", "y", "z", "w"][c as usize];
                for g in 0..gn {
                    let line = if o.shader_f16 {
                        // f16 operands, product rounded to f16, added into the accumulator.
                        format!(
                            "    acc{i}_{g} = acc{i}_{g} + vec4<AccT>(vec4<f16>(a{kk}_{gi}.{comp}) * b{kk}_{g});"
                        )
                    } else {
                        format!(
                            "    acc{i}_{g} = fma(vec4<AccT>(AccT(a{kk}_{gi}.{comp})), vec4<AccT>(b{kk}_{g}), acc{i}_{g});"
                        )
                    };
                    let _ = writeln!(w, "{line}");
                }
            }
        }
    }
    let _ = writeln!(w, "  }}");
    // Store with edge guards.
    for gi in 0..gm {
        for c in 0..4u32 {
            let i = gi * 4 + c;
            let _ = writeln!(w, "  {{ let r = row0 + {}u + tr * 4u + {c}u;", gi * sm);
            let _ = writeln!(w, "    if (r < p.m) {{");
            for g in 0..gn {
                for j in 0..4u32 {
                    let comp = ["x", "y", "z", "w"][j as usize];
                    let _ = writeln!(
                        w,
                        "      {{ let cc = col0 + {}u + tc * 4u + {j}u; if (cc < p.n) {{ let ci = c_base + r * p.ldc + cc; var v = p.alpha * f32(acc{i}_{g}.{comp}); if (p.beta != 0.0) {{ v = v + p.beta * C[ci]; }} C[ci] = v; }} }}",
                        g * sn
                    );
                }
            }
            let _ = writeln!(w, "    }} }}");
        }
    }
    end_main(w, fault);
    s
}

/// The barrier-free form of [`gemm_source`] (see [`GemmOpts::direct`]): the same thread-to-output map
/// and the same per-output sum, with each operand read from storage at every k.
fn direct_source(t: Tile, o: GemmOpts, fault: Option<Fault>) -> String {
    let acc_t = if fault == Some(Fault::F16Accumulation) {
        "f16"
    } else {
        "f32"
    };
    let nt = t.threads();
    let (gm, gn) = (t.tm / 4, t.tn / 4);
    let (sm, sn) = (t.bm / gm, t.bn / gn);
    let mut s = String::new();
    let w = &mut s;
    if acc_t == "f16" {
        let _ = writeln!(w, "enable f16;");
    }
    let _ = writeln!(w, "alias BT = {};", if o.b_f16 { "u32" } else { "f32" });
    let _ = writeln!(w, "alias AccT = {acc_t};");
    let _ = writeln!(w, "{PARAMS}{BINDINGS}");
    let a_idx = if o.trans_a {
        "a_base + k * p.lda + r"
    } else {
        "a_base + r * p.lda + k"
    };
    let b_idx = if o.trans_b {
        "b_base + c * p.ldb + k"
    } else {
        "b_base + k * p.ldb + c"
    };
    let b_read = if o.b_f16 {
        format!("let e = {b_idx}; return unpack2x16float(B[e >> 1u])[e & 1u];")
    } else {
        format!("return B[{b_idx}];")
    };
    let _ = writeln!(
        w,
        "fn ld_a(a_base: u32, r: u32, k: u32) -> f32 {{ if (r >= p.m) {{ return 0.0; }} return A[{a_idx}]; }}
fn ld_b(b_base: u32, k: u32, c: u32) -> f32 {{ if (c >= p.n) {{ return 0.0; }} {b_read} }}
@compute @workgroup_size({nt})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
  let z1 = wid.z / p.b2;
  let z2 = wid.z % p.b2;
  let a_base = p.a_off + z1 * p.sa1 + z2 * p.sa2;
  let b_base = p.b_off + z1 * p.sb1 + z2 * p.sb2;
  let c_base = p.c_off + z1 * p.sc1 + z2 * p.sc2;
  let row0 = wid.y * {bm}u;
  let col0 = wid.x * {bn}u;
  let tr = lid / {tcols}u;
  let tc = lid % {tcols}u;",
        bm = t.bm,
        bn = t.bn,
        tcols = t.bn / t.tn
    );
    for gi in 0..gm {
        for c in 0..4u32 {
            let _ = writeln!(
                w,
                "  let r{} = row0 + {}u + tr * 4u + {c}u;",
                gi * 4 + c,
                gi * sm
            );
        }
    }
    for g in 0..gn {
        let _ = writeln!(w, "  let c{g} = col0 + {}u + tc * 4u;", g * sn);
    }
    for i in 0..t.tm {
        for g in 0..gn {
            let _ = writeln!(w, "  var acc{i}_{g} = vec4<AccT>(0.0);");
        }
    }
    let _ = writeln!(w, "  for (var k = 0u; k < p.k; k = k + 1u) {{");
    for i in 0..t.tm {
        let _ = writeln!(w, "    let a{i} = ld_a(a_base, r{i}, k);");
    }
    for g in 0..gn {
        let _ = writeln!(
            w,
            "    let b{g} = vec4<f32>(ld_b(b_base, k, c{g}), ld_b(b_base, k, c{g} + 1u), ld_b(b_base, k, c{g} + 2u), ld_b(b_base, k, c{g} + 3u));"
        );
    }
    for i in 0..t.tm {
        for g in 0..gn {
            let _ = writeln!(
                w,
                "    acc{i}_{g} = fma(vec4<AccT>(AccT(a{i})), vec4<AccT>(b{g}), acc{i}_{g});"
            );
        }
    }
    let _ = writeln!(w, "  }}");
    for i in 0..t.tm {
        let _ = writeln!(w, "  if (r{i} < p.m) {{");
        for g in 0..gn {
            for j in 0..4u32 {
                let comp = ["x", "y", "z", "w"][j as usize];
                let _ = writeln!(
                    w,
                    "    {{ let cc = c{g} + {j}u; if (cc < p.n) {{ let ci = c_base + r{i} * p.ldc + cc; var v = p.alpha * f32(acc{i}_{g}.{comp}); if (p.beta != 0.0) {{ v = v + p.beta * C[ci]; }} C[ci] = v; }} }}"
                );
            }
        }
        let _ = writeln!(w, "  }}");
    }
    end_main(w, fault);
    s
}

/// The planted faults' extra store (tests only), then the end of `main`: shared by both forms.
fn end_main(w: &mut String, fault: Option<Fault>) {
    match fault {
        // One element past the last row of C: memory the product does not own.
        Some(Fault::OutOfBoundsWrite) => {
            let _ = writeln!(
                w,
                "  if (lid == 0u && wid.x == 0u && wid.y == 0u && wid.z == 0u) {{ C[c_base + p.m * p.ldc] = 1.0; }}"
            );
        }
        Some(Fault::NanOutput) => {
            let _ = writeln!(
                w,
                "  if (lid == 0u && wid.x == 0u && wid.y == 0u && wid.z == 0u) {{ C[c_base] = bitcast<f32>(0x7fc00000u); }}"
            );
        }
        _ => {}
    }
    let _ = writeln!(w, "}}");
}
