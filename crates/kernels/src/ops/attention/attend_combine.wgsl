// Merges the splits of attend_rows.wgsl: for each (row, head), out = Σ_s e^(m_s − M) o_s / Σ_s e^(m_s − M) l_s
// with M the largest split maximum; a split with l_s = 0 (empty) adds nothing. One workgroup per
// (row, head), a thread per output dimension.
struct Params { n: u32, heads: u32, head_dim: u32, ld_o: u32, n_split: u32, o_part: u32, o_out: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let g = group_index(wid, nwg);
  if (g >= p.n) { return; }
  let r = g / p.heads;
  let h = g % p.heads;
  let stride = p.head_dim + 2u;
  let b = p.o_part + g * p.n_split * stride;
  var mx = bitcast<f32>(0xff800000u);
  for (var s = 0u; s < p.n_split; s = s + 1u) {
    if (part[b + s * stride + 1u] > 0.0) { mx = max(mx, part[b + s * stride]); }
  }
  var den = 0.0;
  for (var s = 0u; s < p.n_split; s = s + 1u) {
    let l = part[b + s * stride + 1u];
    if (l > 0.0) { den = den + exp(part[b + s * stride] - mx) * l; }
  }
  for (var d = lid; d < p.head_dim; d = d + 256u) {
    var acc = 0.0;
    for (var s = 0u; s < p.n_split; s = s + 1u) {
      if (part[b + s * stride + 1u] > 0.0) {
        acc = acc + exp(part[b + s * stride] - mx) * part[b + s * stride + 2u + d];
      }
    }
    out[p.o_out + r * p.ld_o + h * p.head_dim + d] = acc / den;
  }
}
