// In-place row softmax of scale * x, one workgroup per row. With causal_t > 0, row r is query position
// q = r % causal_t + causal_offset and columns c > q are masked to exactly 0 (attention's causal mask).
// BACKWARD (in place on dy): dx = scale * y * (dy - sum(dy * y)).
struct Params { n: u32, start: u32, o_x: u32, o_y: u32, cols: u32, scale: f32, causal_t: u32, causal_offset: u32, backward: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;

// reduce_sum / reduce_max and WG: ops/common.rs, ROW_REDUCE.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let row = group_index(wid, nwg);
  if (row >= p.n) { return; }
  var valid = p.cols;
  if (p.causal_t > 0u) { valid = min(p.cols, (p.start + row) % p.causal_t + p.causal_offset + 1u); }
  let base = p.o_x + row * p.cols;
  if (p.backward == 0u) {
    var m = bitcast<f32>(0xff7fffffu); // -f32::MAX, as bits: the decimal literal is out of range for some compilers (Tint)
    for (var c = lid; c < valid; c = c + WG) { m = max(m, p.scale * x[base + c]); }
    m = reduce_max(m, lid);
    var s = 0.0;
    for (var c = lid; c < valid; c = c + WG) { s = s + exp(p.scale * x[base + c] - m); }
    let inv = 1.0 / reduce_sum(s, lid);
    for (var c = lid; c < p.cols; c = c + WG) {
      var v = 0.0;
      if (c < valid) { v = exp(p.scale * x[base + c] - m) * inv; }
      x[base + c] = v;
    }
  } else {
    let yb = p.o_y + row * p.cols;
    var d = 0.0;
    for (var c = lid; c < valid; c = c + WG) { d = d + x[base + c] * y[yb + c]; }
    d = reduce_sum(d, lid);
    for (var c = lid; c < p.cols; c = c + WG) {
      x[base + c] = p.scale * y[yb + c] * (x[base + c] - d);
    }
  }
}
