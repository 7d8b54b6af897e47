//! GGUF files and block-quantized formats.
