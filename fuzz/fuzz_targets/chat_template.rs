#![no_main]
//! See tinygpt_models::fuzzing::chat_template.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tinygpt_models::fuzzing::chat_template(data));
