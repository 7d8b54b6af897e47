// out[i, :] = scale · (dequantized row ids[i]) for the rows of this piece of a Q8 table (ids in [r0, r1)):
// value = block scale · q, q the sign-extended byte. Ids >= rows give zero rows, written by the dispatch
// of the first piece. One workgroup per token; thread c takes words c, c + WG, ... (4 values each).
struct Params { n: u32, o_ids: u32, o_out: u32, words: u32, nb: u32, block: u32, r0: u32, r1: u32,
                rows: u32, first: u32, scale: f32, o_s: u32, o_q: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> quants: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_index(wid, nwg);
  if (i >= p.n) { return; }
  let id = ids[p.o_ids + i];
  let inside = id >= p.r0 && id < p.r1;
  if (!inside && !(id >= p.rows && p.first != 0u)) { return; }
  let ob = p.o_out + i * p.words * 4u;
  let lr = id - p.r0;
  for (var c = lid; c < p.words; c += WG) {
    var v = vec4<f32>(0.0);
    if (inside) {
      let s = scales[p.o_s + lr * p.nb + (4u * c) / p.block];
      // Dequantize first, then scale, as the CPU twin does (same two roundings).
      v = p.scale * (s * sext(quants[p.o_q + lr * p.words + c]));
    }
    out[ob + 4u * c] = v.x;
    out[ob + 4u * c + 1u] = v.y;
    out[ob + 4u * c + 2u] = v.z;
    out[ob + 4u * c + 3u] = v.w;
  }
}
