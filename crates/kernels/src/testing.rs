//! Helpers for tests across the workspace (behind the `testing` feature, which the workspace's crates
//! enable for their tests only): the NMSE metric, poisoned outputs, twin comparisons, and the GPU device
//! the tests run on.
//!
//! GPU tests never pass silently without a GPU: when no adapter opens they fail with instructions,
//! unless `TINYGPT_SKIP_GPU_TESTS=1` says to skip them.

use crate::backend::{Backend, Tensor};
#[cfg(not(target_arch = "wasm32"))]
use crate::device::{BackendChoice, DeviceOptions};

/// Normalised mean squared error Σ(a−b)²/Σa² of `got` against `want` (NaN when either holds a NaN).
pub fn nmse(want: &[f32], got: &[f32]) -> f64 {
    assert_eq!(want.len(), got.len(), "nmse: lengths differ");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&a, &b) in want.iter().zip(got) {
        if !a.is_finite() || !b.is_finite() {
            return f64::NAN;
        }
        let d = a as f64 - b as f64;
        num += d * d;
        den += a as f64 * a as f64;
    }
    if den == 0.0 {
        if num == 0.0 { 0.0 } else { f64::INFINITY }
    } else {
        num / den
    }
}

/// Panics with a readable report unless NMSE(want, got) <= bound.
#[track_caller]
pub fn assert_nmse(what: &str, want: &[f32], got: &[f32], bound: f64) {
    let e = nmse(want, got);
    if e <= bound {
        return;
    }
    let first_bad = want
        .iter()
        .zip(got)
        .position(|(a, b)| !b.is_finite() || (a - b).abs() > 1e-3 * (1.0 + a.abs()));
    let show = |v: &[f32]| {
        v.iter()
            .take(6)
            .map(|x| format!("{x:.6}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    panic!(
        "{what}: NMSE {e:.3e} exceeds {bound:.1e} (n = {})\n  want: [{}]\n  got:  [{}]\n  first differing index: {:?}",
        want.len(),
        show(want),
        show(got),
        first_bad.map(|i| (i, want[i], got[i]))
    );
}

pub use crate::rng::SeedRng;

/// Whether the user asked to skip GPU tests.
pub fn skip_gpu() -> bool {
    std::env::var("TINYGPT_SKIP_GPU_TESTS").is_ok_and(|v| v == "1")
}

/// Whether tests compile the kernels with naga's runtime checks (`TINYGPT_SHADER_CHECKS=1`; off by
/// default, as the program runs them).
pub fn shader_checks() -> bool {
    std::env::var("TINYGPT_SHADER_CHECKS").is_ok_and(|v| v == "1")
}

/// Opens the GPU backend tests run on, under the low-end profile (WebGPU's default limits), optionally
/// splitting tensors at `max_binding` bytes. Returns None only when `TINYGPT_SKIP_GPU_TESTS=1`; with no
/// adapter otherwise, panics with instructions.
#[cfg(not(target_arch = "wasm32"))]
pub fn gpu_backend(max_binding: Option<u64>) -> Option<Backend> {
    let low_end = std::env::var("TINYGPT_TEST_FULL_LIMITS").is_err();
    open_test_gpu(max_binding, low_end, shader_checks())
}

/// The GPU backend under the low-end profile whatever `TINYGPT_TEST_FULL_LIMITS` says (tests of the
/// 128 MiB binding limit itself).
#[cfg(not(target_arch = "wasm32"))]
pub fn gpu_backend_low_end() -> Option<Backend> {
    open_test_gpu(None, true, shader_checks())
}

/// [`gpu_backend`] with the kernels compiled with (`true`) or without naga's runtime checks, whatever
/// `TINYGPT_SHADER_CHECKS` says (tests that the two compiles compute the same values).
#[cfg(not(target_arch = "wasm32"))]
pub fn gpu_backend_with_checks(checks: bool) -> Option<Backend> {
    let low_end = std::env::var("TINYGPT_TEST_FULL_LIMITS").is_err();
    open_test_gpu(None, low_end, checks)
}

#[cfg(not(target_arch = "wasm32"))]
fn open_test_gpu(max_binding: Option<u64>, low_end: bool, checks: bool) -> Option<Backend> {
    if skip_gpu() {
        eprintln!("TINYGPT_SKIP_GPU_TESTS=1: skipping a GPU test");
        return None;
    }
    let opts = DeviceOptions {
        backend: BackendChoice::Gpu,
        adapter: std::env::var("TINYGPT_ADAPTER").ok(),
        low_end,
        max_binding_override: max_binding,
        shader_checks: checks,
        cpu_threads: None,
    };
    match pollster::block_on(crate::device::open(&opts)) {
        Ok((b, _)) => Some(b),
        Err(e) => panic!(
            "GPU tests need a GPU adapter and none could be opened: {e}\n\
             Install one (Debian/Ubuntu: `sudo apt-get install mesa-vulkan-drivers` for a software \
             Vulkan adapter), or set TINYGPT_SKIP_GPU_TESTS=1 to skip GPU tests explicitly."
        ),
    }
}

/// The CPU backend for tests.
pub fn cpu_backend() -> Backend {
    Backend::Cpu(crate::cpu::CpuBackend::new(None))
}

/// A tensor of `len` NaNs: outputs start poisoned so an element an op forgets to write fails the test.
pub fn poisoned(be: &Backend, len: usize, unit: usize) -> crate::Result<Tensor> {
    be.from_f32(&vec![f32::NAN; len], unit)
}

/// Asserts that `f16_form`, writing `n` values as f16 pairs from word 2 of a zeroed u32 tensor, writes
/// the pairs [`crate::ops::matmul::pack_f16`] makes of the values `f32_form` writes, bit for bit, and
/// leaves the words before them alone: the check of every op that writes f16 pairs for the tensor
/// cores against its f32 form.
pub fn assert_f16_pairs(
    be: &Backend,
    n: usize,
    what: &str,
    f32_form: impl FnOnce(crate::TMut<'_>) -> crate::Result<()>,
    f16_form: impl FnOnce(crate::TMut<'_>) -> crate::Result<()>,
) {
    use crate::ops::matmul::{pack_f16, packed_len};
    let mut wide = be.zeros(n, 1).unwrap();
    f32_form(wide.at_mut(0)).unwrap();
    let mut want = be.zeros_typed(packed_len(n), 1, crate::DType::U32).unwrap();
    pack_f16(be, wide.at(0), want.at_mut(0), n).unwrap();
    let mut got = be
        .zeros_typed(packed_len(n) + 2, 1, crate::DType::U32)
        .unwrap();
    f16_form(got.at_mut(2)).unwrap();
    let words =
        |t: &Tensor| -> Vec<u32> { be.to_vec(t).unwrap().iter().map(|f| f.to_bits()).collect() };
    let got = words(&got);
    assert_eq!(&got[..2], &[0, 0], "{what}: the words before the pairs");
    assert_eq!(&got[2..], &words(&want)[..], "{what}");
}

/// One input or output of a twin comparison.
pub struct Arg {
    /// Initial contents (raw words for u32 data); `None` for an output that starts poisoned.
    pub data: Option<Vec<f32>>,
    pub len: usize,
    /// Split unit for GPU allocation.
    pub unit: usize,
    /// Raw u32 words: compared bit for bit, not by NMSE.
    pub words: bool,
}

impl Arg {
    /// An input (or an output that accumulates) holding `data`.
    pub fn data(data: Vec<f32>, unit: usize) -> Self {
        Arg {
            len: data.len(),
            data: Some(data),
            unit,
            words: false,
        }
    }
    /// Token ids or other u32 words.
    pub fn words(data: &[u32], unit: usize) -> Self {
        Arg {
            words: true,
            ..Self::data(bytemuck::cast_slice(data).to_vec(), unit)
        }
    }
    /// An output of `len` elements that starts poisoned with NaN.
    pub fn out(len: usize, unit: usize) -> Self {
        Arg {
            data: None,
            len,
            unit,
            words: false,
        }
    }
}

/// Runs `f` on the CPU backend and on the GPU backend — once with tensors below the binding limit and,
/// when `split_bytes` is given, once with every tensor split into chunks of at most that many bytes —
/// and asserts every output of the GPU runs is within `bound` NMSE of the CPU twin's.
/// `f` gets the tensors in the order of `args` (a fast path's test passes its path set to the ops it
/// calls). Returns the CPU outputs for further checks.
#[cfg(not(target_arch = "wasm32"))]
pub fn check_twin(
    name: &str,
    bound: f64,
    args: &[Arg],
    split_bytes: Option<u64>,
    f: impl Fn(&Backend, &mut [Tensor]) -> crate::Result<()>,
) -> Vec<Vec<f32>> {
    let run = |be: &Backend| -> Vec<Vec<f32>> {
        let mut ts: Vec<Tensor> = args
            .iter()
            .map(|a| match &a.data {
                Some(d) => be.from_f32(d, a.unit),
                None => poisoned(be, a.len, a.unit),
            })
            .collect::<crate::Result<_>>()
            .unwrap_or_else(|e| panic!("{name}: allocating on {}: {e}", be.kind()));
        f(be, &mut ts).unwrap_or_else(|e| panic!("{name} on {}: {e}", be.kind()));
        ts.iter()
            .map(|t| {
                be.to_vec(t)
                    .unwrap_or_else(|e| panic!("{name}: reading back: {e}"))
            })
            .collect()
    };
    let want = run(&cpu_backend());
    let mut gpus = Vec::new();
    if let Some(g) = gpu_backend(None) {
        gpus.push(("gpu", g));
    }
    if let Some(bytes) = split_bytes
        && let Some(g) = gpu_backend(Some(bytes))
    {
        gpus.push(("gpu split", g));
    }
    for (label, be) in &gpus {
        let got = run(be);
        for (i, a) in args.iter().enumerate() {
            if a.words {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&want[i]),
                    bits(&got[i]),
                    "{name} [{label}] tensor {i} (words)"
                );
                continue;
            }
            assert_nmse(
                &format!("{name} [{label}] tensor {i}"),
                &want[i],
                &got[i],
                bound,
            );
            if a.data.is_none() {
                assert!(
                    want[i].iter().all(|x| x.is_finite()),
                    "{name}: CPU twin left tensor {i} unwritten or non-finite"
                );
            }
        }
    }
    want
}
