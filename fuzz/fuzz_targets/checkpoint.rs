#![no_main]
//! See tinygpt_models::fuzzing::checkpoint.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tinygpt_models::fuzzing::checkpoint(data));
