//! SmolLM2-135M-Instruct (llama architecture, Q4_1 with a Q8_0 tied head) against llama.cpp's and
//! transformers' recorded outputs, on the CPU backend and on the GPU under the low-end profile.

mod llm_common;

use llm_common::{SMOLLM2, check_prompt, load};
use tinygpt_kernels::testing::{cpu_backend, gpu_backend};

#[test]
fn smollm2_cpu_matches_references() {
    let be = cpu_backend();
    let (tok, mut llm) = load(&be, &SMOLLM2);
    for name in ["capital", "chat"] {
        check_prompt(&be, &SMOLLM2, &tok, &mut llm, name);
    }
}

#[test]
fn smollm2_gpu_low_end_matches_references() {
    let Some(be) = gpu_backend(None) else { return };
    let (tok, mut llm) = load(&be, &SMOLLM2);
    // The chat prompt (37 tokens) runs the batched prefill; its continuation agrees with llama.cpp's.
    check_prompt(&be, &SMOLLM2, &tok, &mut llm, "chat");
}
