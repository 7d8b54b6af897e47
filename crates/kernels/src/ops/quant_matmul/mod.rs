//! y = x · Wᵀ straight from block-quantized weights (layouts in [`crate::quant`]).

pub mod cpu;
