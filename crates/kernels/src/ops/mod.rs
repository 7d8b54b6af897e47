//! One module per op: its WGSL kernel(s), the Rust that dispatches them, its CPU twin and its tests.

pub mod quant_matmul;
