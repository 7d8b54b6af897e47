// dst[r * ld_dst + c] = src[r * ld_src + c] for rows r in 0..n, columns c in 0..cols: one workgroup per
// row, its threads along the row (consecutive threads, consecutive words).
struct Params { n: u32, start: u32, o_src: u32, o_dst: u32, ld_src: u32, ld_dst: u32, cols: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let r = group_index(wid, nwg);
  if (r >= p.n) { return; }
  let s = p.o_src + r * p.ld_src;
  let d = p.o_dst + r * p.ld_dst;
  for (var c = lid; c < p.cols; c = c + 128u) { dst[d + c] = src[s + c]; }
}
