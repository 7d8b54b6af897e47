//! CPU quantized matmul (being written).
