// The parameters and bindings of the norm's forward kernels (forward.wgsl, forward_rows4.wgsl).
struct Params { n: u32, start: u32, o_x: u32, o_w: u32, o_y: u32, o_mean: u32, o_rstd: u32, cols: u32, eps: f32, rms: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read_write> mean_out: array<f32>;
@group(0) @binding(5) var<storage, read_write> rstd_out: array<f32>;
