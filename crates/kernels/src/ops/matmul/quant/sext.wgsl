// The four signed bytes of a little-endian word as f32. Byte j is shifted to the top of the i32, then back
// down arithmetically, which copies its sign bit over the upper 24 bits (two's-complement sign extension);
// every value in -128..=127 is exact in f32. gpu.rs puts this in front of every quantized kernel.
fn sext(w: u32) -> vec4<f32> {
  return vec4<f32>((vec4<i32>(bitcast<i32>(w)) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}
