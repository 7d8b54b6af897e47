//! GGUF files and block-quantized formats.
//!
//! - [`gguf`]: the container. [`GgufFile::open`] memory-maps and validates a file (v2 or v3),
//!   [`GgufFile::from_bytes`] does the same for a buffer (tests, wasm); [`GgufWriter`] writes v3 files
//!   atomically.
//! - [`blocks`]: ggml's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) with their dequantization
//!   twins, exact repacking into the kernel layouts of `tinygpt_kernels::quant`, and quantizers.
//! - [`load_matrix`]: one tensor's bytes to [`KernelWeights`]; [`dequantize_tensor`] and
//!   [`dequantize_row`] to f32; [`quantize`] from f32.
//!
//! Input files are untrusted: malformed data yields a [`FormatError`] describing the field, offset and
//! expectation, never a panic or an allocation larger than the file justifies.

pub mod blocks;
pub mod error;
pub mod ggml_type;
pub mod gguf;
pub mod tensor;

pub use error::FormatError;
pub use ggml_type::GgmlType;
pub use gguf::{
    GgufFile, GgufHeader, GgufWriter, Metadata, MetadataArray, MetadataValue, TensorInfo, ValueType,
};
pub use tensor::{
    KernelWeights, dequantize_bytes, dequantize_row, dequantize_tensor, load_matrix, quantize,
    repack_q4, repack_q8,
};
