// Merges the splits of attend_rows.wgsl: for each (row, head), out = Σ_s e^(m_s − M) o_s / Σ_s e^(m_s − M) l_s
// with M the largest split maximum; a split with l_s = 0 (empty) adds nothing. One workgroup per
// (row, head), a thread per output dimension.
//
// Built for latency (a decode step waits on it): the splits' maxima, sums and weights e^(m_s − M) are
// loaded and computed by one thread each into workgroup memory (256 splits at a time), then each
// output dimension sums its splits in order, four loads issued before their additions. The sums are
// those of a serial loop over the splits in order: the same values added in the same order.
struct Params { n: u32, heads: u32, head_dim: u32, ld_o: u32, n_split: u32, o_part: u32, o_out: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

const WG: u32 = 256u;
// Per split of the current chunk: its weight e^(m_s − M) and its sum l_s (0: empty, skipped).
var<workgroup> wt: array<f32, WG>;
var<workgroup> ls: array<f32, WG>;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let g = group_index(wid, nwg);
  // The whole workgroup leaves together (it meets barriers below).
  if (g >= p.n) { return; }
  let r = g / p.heads;
  let h = g % p.heads;
  let stride = p.head_dim + 2u;
  let b = p.o_part + g * p.n_split * stride;
  // M: the largest maximum of a non-empty split (max is exact in any order).
  // -inf from a variable: a constant expression of it is an error in WGSL (Tint refuses it).
  var ninf_bits = 0xff800000u;
  var mx = bitcast<f32>(ninf_bits);
  for (var s = lid; s < p.n_split; s = s + WG) {
    if (part[b + s * stride + 1u] > 0.0) { mx = max(mx, part[b + s * stride]); }
  }
  red[lid] = mx;
  workgroupBarrier();
  for (var k = WG / 2u; k > 0u; k = k >> 1u) {
    if (lid < k) { red[lid] = max(red[lid], red[lid + k]); }
    workgroupBarrier();
  }
  mx = red[0];
  for (var d0 = 0u; d0 < p.head_dim; d0 = d0 + WG) {
    let d = d0 + lid;
    var den = 0.0;
    var acc = 0.0;
    for (var c = 0u; c < p.n_split; c = c + WG) {
      let cnt = min(WG, p.n_split - c);
      workgroupBarrier();
      if (lid < cnt) {
        let s = c + lid;
        let l = part[b + s * stride + 1u];
        ls[lid] = l;
        wt[lid] = select(0.0, exp(part[b + s * stride] - mx), l > 0.0);
      }
      workgroupBarrier();
      for (var j = 0u; j < cnt; j = j + 1u) {
        if (ls[j] > 0.0) { den = den + wt[j] * ls[j]; }
      }
      if (d < p.head_dim) {
        let o = b + c * stride + 2u + d;
        var j = 0u;
        for (; j + 4u <= cnt; j = j + 4u) {
          let v0 = part[o + j * stride];
          let v1 = part[o + (j + 1u) * stride];
          let v2 = part[o + (j + 2u) * stride];
          let v3 = part[o + (j + 3u) * stride];
          if (ls[j] > 0.0) { acc = acc + wt[j] * v0; }
          if (ls[j + 1u] > 0.0) { acc = acc + wt[j + 1u] * v1; }
          if (ls[j + 2u] > 0.0) { acc = acc + wt[j + 2u] * v2; }
          if (ls[j + 3u] > 0.0) { acc = acc + wt[j + 3u] * v3; }
        }
        for (; j < cnt; j = j + 1u) {
          if (ls[j] > 0.0) { acc = acc + wt[j] * part[o + j * stride]; }
        }
      }
    }
    if (d < p.head_dim) {
      out[p.o_out + r * p.ld_o + h * p.head_dim + d] = acc / den;
    }
  }
}
