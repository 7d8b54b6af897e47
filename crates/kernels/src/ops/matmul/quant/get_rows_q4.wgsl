// out[i, :] = scale · (dequantized row ids[i]) for the rows of this piece of a Q4 table (ids in [r0, r1)):
// value = block scale · q + block min. Ids >= rows give zero rows, written by the dispatch of the first
// piece. One workgroup per token; thread c takes words c, c + WG, ...: word c is word c % 4 of block c / 4,
// whose low nibbles are values 4(c % 4) .. +3 of the block and high nibbles values 16 + 4(c % 4) .. +3.
struct Params { n: u32, o_ids: u32, o_out: u32, words: u32, nb: u32, block: u32, r0: u32, r1: u32,
                rows: u32, first: u32, scale: f32, o_s: u32, o_q: u32, o_m: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;
@group(0) @binding(4) var<storage, read> mins: array<f32>;
@group(0) @binding(5) var<storage, read> quants: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_index(wid, nwg);
  if (i >= p.n) { return; }
  let id = ids[p.o_ids + i];
  let inside = id >= p.r0 && id < p.r1;
  if (!inside && !(id >= p.rows && p.first != 0u)) { return; }
  let ob = p.o_out + i * p.words * 8u;
  let lr = id - p.r0;
  for (var c = lid; c < p.words; c += WG) {
    var lo = vec4<f32>(0.0);
    var hi = vec4<f32>(0.0);
    if (inside) {
      let b = lr * p.nb + c / 4u;
      let s = scales[p.o_s + b];
      let mn = mins[p.o_m + b];
      let bytes = vec4<u32>(quants[p.o_q + lr * p.words + c]) >> vec4<u32>(0u, 8u, 16u, 24u);
      lo = p.scale * (s * vec4<f32>(bytes & vec4<u32>(15u)) + mn);
      hi = p.scale * (s * vec4<f32>((bytes >> vec4<u32>(4u)) & vec4<u32>(15u)) + mn);
    }
    let base = ob + (c / 4u) * 32u + (c % 4u) * 4u;
    out[base] = lo.x;
    out[base + 1u] = lo.y;
    out[base + 2u] = lo.z;
    out[base + 3u] = lo.w;
    out[base + 16u] = hi.x;
    out[base + 17u] = hi.y;
    out[base + 18u] = hi.z;
    out[base + 19u] = hi.w;
  }
}
