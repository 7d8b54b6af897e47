//! The decode kernel: y = alpha · x · Wᵀ + beta · y for up to 8 rows of x, the shape of one token (or a
//! few) through a linear layer. The weights dominate the traffic, so W is read once for every row of x.

use std::fmt::Write;

use super::tiled::GemmOpts;
use crate::path::Fault;

/// WGSL for y = alpha · x · Wᵀ + beta · y over `rows` (1 to 8) rows of x (decoding): one W row per
/// 32-thread slice, eight slices per workgroup, each slice striding along K (coalesced, W read once for
/// every x row), partial sums meeting in workgroup memory behind one barrier — or, with subgroups,
/// summed by `subgroupAdd` first so only one value per subgroup goes through workgroup memory.
///
/// The row count is a constant of the kernel: each row's accumulator is a scalar of its own and every
/// per-row line is written out, so no compiler indexes a private array with a loop counter (SwiftShader
/// and lavapipe run such code many times slower) and no lane tests rows that do not exist. Each row's
/// sum is accumulated in the same order whatever `rows` is.
pub fn gemv_source(o: GemmOpts, rows: usize, subgroups: bool, fault: Option<Fault>) -> String {
    assert!(
        (1..=8).contains(&rows),
        "the decode kernel takes 1 to 8 rows"
    );
    let st = if o.shader_f16 { "f16" } else { "f32" };
    let acc_t = if fault == Some(Fault::F16Accumulation) {
        "f16"
    } else {
        "f32"
    };
    let each = |line: &dyn Fn(usize) -> String| (0..rows).map(line).collect::<Vec<_>>().join("\n");
    let mut s = String::new();
    let w = &mut s;
    if o.shader_f16 || acc_t == "f16" {
        let _ = writeln!(w, "enable f16;");
    }
    let _ = writeln!(
        w,
        "alias BT = {};\nalias ST = {st};\nalias AccT = {acc_t};",
        if o.b_f16 { "u32" } else { "f32" }
    );
    // Directives (`enable`) must come first, so the shared prelude goes in here, after them.
    let _ = writeln!(w, "{}", crate::ops::common::PRELUDE);
    let _ = writeln!(w, "{}", GEMV_PARAMS);
    let wload = if o.b_f16 {
        "unpack2x16float(B[(wb + k) >> 1u])[(wb + k) & 1u]"
    } else {
        "B[wb + k]"
    };
    let term = |i: usize| {
        if o.shader_f16 {
            format!("AccT(ST(A[p.a_off + {i}u * p.lda + k]) * ST(wv))")
        } else {
            format!("AccT(A[p.a_off + {i}u * p.lda + k] * wv)")
        }
    };
    let sg_params = if subgroups {
        ", @builtin(subgroup_invocation_id) sgi: u32, @builtin(subgroup_size) sgs: u32"
    } else {
        ""
    };
    let _ = writeln!(
        w,
        "var<workgroup> part: array<f32, {}>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32{sg_params}) {{
  let slice = lid / 32u;
  let lane = lid % 32u;
  let col = group_index(wid, nwg) * 8u + slice;
{}
  if (col < p.n) {{
    let wb = p.b_off + col * p.ldb;
    for (var k = lane; k < p.k; k = k + 32u) {{
      let wv = {wload};
{}
    }}
  }}",
        256 * rows,
        each(&|i| format!("  var acc{i} = AccT(0);")),
        each(&|i| format!("      acc{i} = acc{i} + {};", term(i))),
    );
    if subgroups {
        // Each subgroup (at most 32 lanes, all in one slice) sums its lanes; its first lane posts the sum.
        let _ = writeln!(
            w,
            "{}
  if (sgi == 0u) {{
{}
  }}
  workgroupBarrier();
  let per = 32u / sgs;
  if (lid < {}u) {{
    let i = lid / 8u;
    let s = lid % 8u;
    let c = group_index(wid, nwg) * 8u + s;
    if (c < p.n) {{
      var sum = 0.0;
      for (var l = 0u; l < per; l = l + 1u) {{ sum = sum + part[i * 256u + s * per + l]; }}",
            each(&|i| format!("  let t{i} = subgroupAdd(f32(acc{i}));")),
            each(&|i| format!("    part[{i}u * 256u + lid / sgs] = t{i};")),
            8 * rows
        );
    } else {
        let _ = writeln!(
            w,
            "{}
  workgroupBarrier();
  if (lid < {}u) {{
    let i = lid / 8u;
    let s = lid % 8u;
    let c = group_index(wid, nwg) * 8u + s;
    if (c < p.n) {{
      var sum = 0.0;
      for (var l = 0u; l < 32u; l = l + 1u) {{ sum = sum + part[i * 256u + s * 32u + l]; }}",
            each(&|i| format!("  part[{i}u * 256u + lid] = f32(acc{i});")),
            8 * rows
        );
    }
    let _ = writeln!(
        w,
        "      let ci = p.c_off + i * p.ldc + c;
      var v = p.alpha * sum;
      if (p.beta != 0.0) {{ v = v + p.beta * C[ci]; }}
      C[ci] = v;
    }}
  }}"
    );
    match fault {
        Some(Fault::OutOfBoundsWrite) => {
            let _ = writeln!(
                w,
                "  if (lid == 0u && group_index(wid, nwg) == 0u) {{ C[p.c_off + p.m * p.ldc] = 1.0; }}"
            );
        }
        Some(Fault::NanOutput) => {
            let _ = writeln!(
                w,
                "  workgroupBarrier();\n  if (lid == 0u && group_index(wid, nwg) == 0u) {{ C[p.c_off] = bitcast<f32>(0x7fc00000u); }}"
            );
        }
        _ => {}
    }
    let _ = writeln!(w, "}}");
    s
}

const GEMV_PARAMS: &str = "struct Params { m: u32, n: u32, k: u32, lda: u32, ldb: u32, ldc: u32, a_off: u32, b_off: u32, c_off: u32, alpha: f32, beta: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<BT>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;
";
