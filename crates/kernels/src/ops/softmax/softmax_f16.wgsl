// softmax.wgsl's register form (rows of at most 4 · TPR columns, an even number of them) for the
// tensor-core training path, whose products read attention's T x T matrices as f16 pairs: the same
// arithmetic in the same order (the same bits), with the values the products read written as pairs
// (`pack2x16float`, as pack_f16.wgsl rounds).
// FORWARD: x ← the probabilities (f32, kept for the backward pass, which reads the columns each row
// sees: the masked ones are left as they were); d ← the dropped-out probabilities (the probabilities
// themselves without dropout) as pairs, the masked columns 0.
// BACKWARD: d ← the scores' gradient as pairs; x (dy) is left as it is.
// A row's values go through workgroup memory, so that a thread stores two neighbouring columns.
struct Params { n: u32, start: u32, o_x: u32, o_y: u32, o_d: u32, cols: u32, scale: f32, causal_t: u32,
                causal_offset: u32, backward: u32, has_drop: u32, threshold: u32, seed: u32, drop_scale: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> d: array<u32>;

// row_sum / row_max, TPR and ROWS: ops/common.rs, ROWS4; hash: ops/dropout/hash.wgsl.

var<workgroup> stage: array<f32, 1024>; // ROWS rows of 4 · TPR columns

// Dropout of v at column c of this row (v itself without dropout): softmax.wgsl's.
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
  var valid = 0u;
  var cols = 0u;
  if (row < p.n) {
    cols = p.cols;
    valid = p.cols;
    if (p.causal_t > 0u) { valid = min(p.cols, (p.start + row) % p.causal_t + p.causal_offset + 1u); }
  }
  let base = p.o_x + row * p.cols;
  let sb = (lid / TPR) * 4u * TPR;
  // Lines holding `$j` are written out for j = 0 .. 3 (softmax/mod.rs).
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
    if (c$j < cols) { let o = e$j * inv; if (c$j < valid) { x[base + c$j] = o; } stage[sb + c$j] = dropped(o, row, c$j); }
  } else {
    let yb = p.o_y + row * p.cols;
    var s = 0.0;
    var g$j = 0.0;
    var y$j = 0.0;
    if (c$j < valid) { g$j = dropped(x[base + c$j], row, c$j); y$j = y[yb + c$j]; s = s + g$j * y$j; }
    s = row_sum(s, lid);
    if (c$j < cols) { var o = 0.0; if (c$j < valid) { o = p.scale * y$j * (g$j - s); } stage[sb + c$j] = o; }
  }
  workgroupBarrier();
  // Pairs lane and lane + TPR of the row: columns 2q and 2q + 1.
  let db = p.o_d + row * (p.cols / 2u);
  for (var q = lane; 2u * q < cols; q = q + TPR) {
    d[db + q] = pack2x16float(vec2<f32>(stage[sb + 2u * q], stage[sb + 2u * q + 1u]));
  }
}
