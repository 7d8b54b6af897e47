//! Gemma-3-270M (gemma3 architecture, Q4_K_M: Q5_0 / Q8_0 / Q4_K / Q6_K matrices, a 262144 x 640 Q8_0
//! tied head) against llama.cpp's and transformers' recorded outputs, on the CPU backend and on the GPU
//! under the low-end profile, where the head does not fit one 128 MiB binding and is split.

mod llm_common;

use llm_common::{GEMMA3, check_prompt, load};
use tinygpt_kernels::testing::{cpu_backend, gpu_backend};

#[test]
fn gemma3_cpu_matches_references() {
    let be = cpu_backend();
    let (tok, mut llm) = load(&be, &GEMMA3);
    for name in ["capital", "code"] {
        check_prompt(&be, &GEMMA3, &tok, &mut llm, name);
    }
}

#[test]
fn gemma3_gpu_low_end_matches_references() {
    let Some(be) = gpu_backend(None) else { return };
    let (tok, mut llm) = load(&be, &GEMMA3);
    check_prompt(&be, &GEMMA3, &tok, &mut llm, "capital");
}
