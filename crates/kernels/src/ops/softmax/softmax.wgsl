// In-place row softmax of scale * x, four rows per workgroup of 256 (64 threads per row). With
// causal_t > 0, row r is query position q = r % causal_t + causal_offset and columns c > q are masked
// to exactly 0 (attention's causal mask).
// BACKWARD (in place on dy): dx = scale * y * (dy - sum(dy * y)).
// With has_drop, dropout (ops/dropout: the mask of element i is keep(i), i counted over the whole
// tensor) is fused in: the forward pass also writes the dropped-out probabilities to d, and the
// backward pass reads dy as the gradient of the dropped-out probabilities (dropout's backward applied
// as each element is read). The values are those of the separate dropout kernel, bit for bit.
struct Params { n: u32, start: u32, o_x: u32, o_y: u32, o_d: u32, cols: u32, scale: f32, causal_t: u32,
                causal_offset: u32, backward: u32, has_drop: u32, threshold: u32, seed: u32, drop_scale: f32,
                registers: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> d: array<f32>;

// row_sum / row_max, TPR and ROWS: ops/common.rs, ROWS4; hash: ops/dropout/hash.wgsl.

// Dropout of v at column c of this row (v itself without dropout).
fn dropped(v: f32, row: u32, c: u32) -> f32 {
  if (p.has_drop == 0u) { return v; }
  let keep = hash(((p.start + row) * p.cols + c) ^ hash(p.seed)) >= p.threshold;
  return select(0.0, v * p.drop_scale, keep);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let row = group_index(wid, nwg) * ROWS + lid / TPR;
  let lane = lid % TPR;
  // A thread past the last row still takes part in the reductions' barriers, over no columns.
  var valid = 0u;
  var cols = 0u;
  if (row < p.n) {
    cols = p.cols;
    valid = p.cols;
    if (p.causal_t > 0u) { valid = min(p.cols, (p.start + row) % p.causal_t + p.causal_offset + 1u); }
  }
  let base = p.o_x + row * p.cols;
  // Rows of at most 4 · TPR columns (attention's over 256 positions): each thread holds its four
  // columns in registers, read once, and computes every value as the loops below do, in their order
  // (the same bits). Lines holding `$j` are written out for j = 0 .. 3 (softmax/mod.rs).
  if (p.registers != 0u && p.cols <= 4u * TPR) {
    let c$j = lane + $j * TPR;
    if (p.backward == 0u) {
      var m = bitcast<f32>(0xff7fffffu);
      var v$j = 0.0;
      if (c$j < valid) { v$j = p.scale * x[base + c$j]; m = max(m, v$j); }
      m = row_max(m, lid);
      var s = 0.0;
      var e$j = 0.0;
      if (c$j < valid) { e$j = exp(v$j - m); s = s + e$j; }
      let inv = 1.0 / row_sum(s, lid);
      let db = p.o_d + row * p.cols;
      if (c$j < cols) { let o = e$j * inv; x[base + c$j] = o; if (p.has_drop != 0u) { d[db + c$j] = dropped(o, row, c$j); } }
    } else {
      let yb = p.o_y + row * p.cols;
      var s = 0.0;
      var g$j = 0.0;
      var y$j = 0.0;
      if (c$j < valid) { g$j = dropped(x[base + c$j], row, c$j); y$j = y[yb + c$j]; s = s + g$j * y$j; }
      s = row_sum(s, lid);
      if (c$j < cols) { var o = 0.0; if (c$j < valid) { o = p.scale * y$j * (g$j - s); } x[base + c$j] = o; }
    }
    return;
  }
  if (p.backward == 0u) {
    var m = bitcast<f32>(0xff7fffffu); // -f32::MAX, as bits: the decimal literal is out of range for some compilers (Tint)
    for (var c = lane; c < valid; c = c + TPR) { m = max(m, p.scale * x[base + c]); }
    m = row_max(m, lid);
    var s = 0.0;
    for (var c = lane; c < valid; c = c + TPR) { s = s + exp(p.scale * x[base + c] - m); }
    let inv = 1.0 / row_sum(s, lid);
    let db = p.o_d + row * p.cols;
    for (var c = lane; c < cols; c = c + TPR) {
      var v = 0.0;
      if (c < valid) { v = exp(p.scale * x[base + c] - m) * inv; }
      x[base + c] = v;
      if (p.has_drop != 0u) { d[db + c] = dropped(v, row, c); }
    }
  } else {
    let yb = p.o_y + row * p.cols;
    var s = 0.0;
    for (var c = lane; c < valid; c = c + TPR) { s = s + dropped(x[base + c], row, c) * y[yb + c]; }
    s = row_sum(s, lid);
    // Masked columns get exactly 0 without reading them: a causal product may leave them unwritten.
    for (var c = lane; c < cols; c = c + TPR) {
      var v = 0.0;
      if (c < valid) { v = p.scale * y[yb + c] * (dropped(x[base + c], row, c) - s); }
      x[base + c] = v;
    }
  }
}
