//! One module per op: its WGSL kernel(s), the Rust that dispatches them, its CPU twin and its tests.
//! Every op takes the backend first, then views of its tensors, then explicit sizes.

pub(crate) mod common;

pub mod adamw;
pub mod add;
pub mod attention;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod fill;
pub mod gelu;
pub mod glu;
pub mod matmul;
pub mod matmul_coop;
pub mod matmul_f16;
pub mod norm;
pub mod quant_matmul;
pub mod reduce;
pub mod rope;
pub mod softmax;

#[cfg(test)]
mod tests;
