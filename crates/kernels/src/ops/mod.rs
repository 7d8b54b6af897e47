//! One module per op: its WGSL kernel(s), the Rust that dispatches them, its CPU twin and its tests.
//! Every op takes the backend first, then views of its tensors, then explicit sizes.

pub(crate) mod common;

pub mod adamw;
pub mod add;
pub mod argmax;
pub mod attention;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod fastmath;
pub mod fill;
pub mod gelu;
pub mod glu;
pub mod matmul;
pub mod norm;
pub mod reduce;
pub mod rope;
pub mod sample;
pub mod softmax;

/// How a backward op writes a gradient: overwriting its output, or adding into it (a tensor that
/// already holds another branch's contribution, such as the residual stream's gradient).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grad {
    Overwrite,
    Accumulate,
}

#[cfg(test)]
mod tests;
