#![no_main]
//! See tinygpt::serve::fuzzing: one HTTP request from the input through `tinygpt serve`'s router.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tinygpt::serve::fuzzing::request(data);
});
