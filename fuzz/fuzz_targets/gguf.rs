#![no_main]
//! See tinygpt_models::fuzzing::gguf.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tinygpt_models::fuzzing::gguf(data));
