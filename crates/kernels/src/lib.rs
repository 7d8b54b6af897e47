//! TinyGPT's compute layer: the device layer, WGSL kernels with their CPU twins, and the numerics gate.
//! It knows nothing about models or file formats.

pub mod quant;
pub mod ops;
