//! One module per op: its WGSL kernel(s), the Rust that dispatches them, its CPU twin and its tests.
//! Every op takes the backend first, then views of its tensors, then explicit sizes.

pub(crate) mod common;

pub mod add;
pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod gelu;
pub mod glu;
pub mod fill;
pub mod matmul;
pub mod norm;
pub mod softmax;
pub mod quant_matmul;
pub mod reduce;
pub mod rope;

#[cfg(test)]
mod tests;
