//! y = x · Wᵀ straight from block-quantized weights (layouts in [`crate::quant`]).

pub mod cpu;
#[cfg(target_arch = "x86_64")]
mod cpu_avx2;
#[cfg(target_arch = "x86_64")]
mod cpu_avx512;
