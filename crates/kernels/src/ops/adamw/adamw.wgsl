// AdamW with decoupled weight decay, as torch.optim.AdamW computes it, with the gradient scaled for
// global-norm clipping from a norm^2 computed earlier on the device (no host round trip):
//   clip = min(1, max_norm / (sqrt(norm_sq) + 1e-6));  g = grad * clip / grad_scale (loss scaling)
//   p = p * (1 - lr * wd);  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
struct Params { n: u32, start: u32, o_p: u32, o_g: u32, o_m: u32, o_v: u32, o_norm: u32,
                lr: f32, b1: f32, b2: f32, eps: f32, wd: f32, bc1: f32, bc2_sqrt: f32, max_norm: f32, clip: u32,
                unscale: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> param: array<f32>;
@group(0) @binding(2) var<storage, read> grad: array<f32>;
@group(0) @binding(3) var<storage, read_write> m1: array<f32>;
@group(0) @binding(4) var<storage, read_write> m2: array<f32>;
@group(0) @binding(5) var<storage, read> norm_sq: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = group_index(wid, nwg) * 256u + lid;
  if (i >= p.n) { return; }
  var scale = 1.0;
  if (p.clip != 0u) { scale = min(1.0, p.max_norm / (sqrt(norm_sq[p.o_norm]) + 1e-6)); }
  let g = grad[p.o_g + i] * (scale * p.unscale);
  let m = p.b1 * m1[p.o_m + i] + (1.0 - p.b1) * g;
  let v = p.b2 * m2[p.o_v + i] + (1.0 - p.b2) * g * g;
  m1[p.o_m + i] = m;
  m2[p.o_v + i] = v;
  let w = param[p.o_p + i] * (1.0 - p.lr * p.wd);
  param[p.o_p + i] = w - (p.lr / p.bc1) * m / (sqrt(v) / p.bc2_sqrt + p.eps);
}
