// Rotary position embedding, in place, one thread per (row, head, pair). Row r is position pos0 + r.
// Normal (GGUF/llama) layout rotates pairs (2i, 2i+1); NeoX layout rotates (i, i + n_rot/2).
// cos/sin come from a table [position][pair] = (cos, sin) built on the host, so every backend rotates
// by exactly the same angles. INVERSE rotates backwards (the backward pass).
struct Params { n: u32, start: u32, o_x: u32, o_tab: u32, heads: u32, head_dim: u32, n_rot: u32, ld: u32, pos0: u32, neox: u32, inverse: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> tab: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let half = p.n_rot / 2u;
  let e = group_index(wid, nwg) * 256u + lid;
  if (e >= p.n * p.heads * half) { return; }
  let r = e / (p.heads * half);
  let h = (e / half) % p.heads;
  let i = e % half;
  let base = p.o_x + r * p.ld + h * p.head_dim;
  var i0 = base + 2u * i;
  var i1 = i0 + 1u;
  if (p.neox != 0u) { i0 = base + i; i1 = base + i + half; }
  let t = p.o_tab + ((p.start + r + p.pos0) * half + i) * 2u;
  let c = tab[t];
  var s = tab[t + 1u];
  if (p.inverse != 0u) { s = -s; }
  let a = x[i0];
  let b = x[i1];
  x[i0] = a * c - b * s;
  x[i1] = a * s + b * c;
}
