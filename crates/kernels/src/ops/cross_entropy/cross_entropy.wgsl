// Fused softmax cross-entropy, one workgroup per row of logits:
//   loss = logsumexp(x) - x[target];  dlogits = (softmax(x) - onehot(target)) * grad_scale.
// A target >= vocab (u32::MAX marks padding) contributes zero loss and zero gradient.
struct Params { n: u32, start: u32, o_x: u32, o_t: u32, o_loss: u32, o_dx: u32, vocab: u32, grad_scale: f32, grads: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<u32>;
@group(0) @binding(3) var<storage, read_write> loss: array<f32>;
@group(0) @binding(4) var<storage, read_write> dx: array<f32>;

// reduce_sum / reduce_max and WG: ops/common.rs, ROW_REDUCE.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let row = group_index(wid, nwg);
  if (row >= p.n) { return; }
  let base = p.o_x + row * p.vocab;
  let t = targets[p.o_t + row];
  var m = bitcast<f32>(0xff7fffffu); // -f32::MAX, as bits: the decimal literal is out of range for some compilers (Tint)
  for (var c = lid; c < p.vocab; c = c + WG) { m = max(m, x[base + c]); }
  m = reduce_max(m, lid);
  var s = 0.0;
  for (var c = lid; c < p.vocab; c = c + WG) { s = s + exp(x[base + c] - m); }
  s = reduce_sum(s, lid);
  let lse = m + log(s);
  let ignore = t >= p.vocab;
  if (lid == 0u) {
    var l = 0.0;
    if (!ignore) { l = lse - x[base + t]; }
    loss[p.o_loss + row] = l;
  }
  if (p.grads != 0u) {
    let db = p.o_dx + row * p.vocab;
    for (var c = lid; c < p.vocab; c = c + WG) {
      var g = 0.0;
      if (!ignore) { g = exp(x[base + c] - lse) - select(0.0, 1.0, c == t); }
      dx[db + c] = g * p.grad_scale;
    }
  }
}
