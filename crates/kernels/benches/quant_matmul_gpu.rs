//! Batch-1 decode speed of the GPU quantized matmul (`qmatmul`, m = 1) on the real model shapes.
//!
//! `cargo bench -p tinygpt-kernels --bench quant_matmul_gpu [-- SECTION...] [--low-end] [--footprint=MiB]`
//! with sections `calls`, `step`, `prompt` (default: all); `TINYGPT_ADAPTER` picks the adapter (index
//! or part of its name, as `--adapter` does).
//!
//! How it times: `iters` calls are recorded into one compute pass, then one sync. The table gives both
//! phases, neither subtracted from the other: `rec` is the CPU time to record one call (bind group lookup,
//! parameter block), `gpu` the time from the submit at sync to the device being done, per call. All calls
//! write the same y, so they run one after another as a decode step's matmuls do (no overlap between
//! calls). GB/s counts the weight bytes one call reads (quants, f32 scales, f32 mins) over `gpu`.
//!
//! Caches: in `calls`, each shape rotates over enough copies of its weights to cover `--footprint`
//! (default 256 MiB, several times a large GPU's L2), so every call streams its weights from memory;
//! the `hot` column repeats one copy (L2-resident when it fits: an upper bound, not a decode number).
//! `step` runs a whole model's matrices layer by layer, each layer with its own weights.
//! On a software adapter (lavapipe) the numbers only show that the kernels run.

use std::time::Instant;

use tinygpt_kernels::device::{BackendChoice, DeviceOptions, open};
use tinygpt_kernels::ops::matmul::{Gemm, QKind, QMatrix, QuantSource, matmul};
use tinygpt_kernels::quant::{Q4Matrix, Q8Matrix};
use tinygpt_kernels::rng::SeedRng;
use tinygpt_kernels::{Backend, Tensor};
use tinygpt_kernels::{PathId, PathSet, TMut, TRef};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sections: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with("--"))
        .map(|s| s.as_str())
        .collect();
    let want = |s: &str| sections.is_empty() || sections.contains(&s);
    let low_end = args.iter().any(|a| a == "--low-end");
    let footprint = args
        .iter()
        .find_map(|a| a.strip_prefix("--footprint="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(256)
        << 20;
    let opts = DeviceOptions {
        backend: BackendChoice::Gpu,
        adapter: std::env::var("TINYGPT_ADAPTER").ok(),
        low_end,
        max_binding_override: None,
        shader_checks: std::env::var("TINYGPT_SHADER_CHECKS").is_ok_and(|v| v == "1"),
        cpu_threads: None,
    };
    let be = match pollster::block_on(open(&opts)) {
        Ok((be, _)) => be,
        Err(e) => {
            eprintln!("quant_matmul_gpu: no GPU adapter: {e}");
            return;
        }
    };
    println!("device: {}", be.describe());
    if want("calls") {
        calls(&be, footprint);
    }
    if want("step") {
        step(
            &be,
            "SmolLM2-135M (Q4_1 layers -> Q4, Q8_0 head -> Q8b32)",
            &smollm(),
        );
        step(
            &be,
            "Gemma-3-270M (Q4_K_M: Q5_0/Q8_0 -> Q8b32, Q4_K -> Q4, Q6_K -> Q8b16)",
            &gemma(),
        );
    }
    if want("prompt") {
        prompt(&be);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Weights

fn matrix(rng: &mut SeedRng, kind: QKind, n: usize, k: usize) -> QuantSource {
    let words = n * kind.words_per_row(k);
    let mut quants = Vec::with_capacity(words + 1);
    while quants.len() < words {
        let r = rng.next_u64();
        quants.extend([r as u32, (r >> 32) as u32]);
    }
    quants.truncate(words);
    let nb = n * k / kind.block();
    let mut sc = |len: usize| rng.vec(len, -0.02, 0.02);
    match kind {
        QKind::Q8 { block } => Q8Matrix {
            rows: n,
            cols: k,
            block,
            scales: sc(nb),
            quants,
        }
        .into(),
        QKind::Q4 => Q4Matrix {
            rows: n,
            cols: k,
            scales: sc(nb),
            mins: sc(nb),
            quants,
        }
        .into(),
    }
}

/// The quantized kernels are what this benchmark times: they are in its path set.
fn quantized() -> PathSet {
    PathSet::of(&[PathId::QuantMatmul])
}

fn upload(be: &Backend, src: QuantSource) -> QMatrix {
    QMatrix::upload(be, src, quantized()).unwrap_or_else(|e| panic!("upload: {e}"))
}

fn qmatmul(
    be: &Backend,
    x: TRef<'_>,
    w: &QMatrix,
    y: TMut<'_>,
    m: usize,
) -> tinygpt_kernels::Result<()> {
    matmul(be, quantized(), x, w, y, &Gemm::nt(m, w.rows(), w.cols()))
}

fn tensor(be: &Backend, rng: &mut SeedRng, len: usize) -> Tensor {
    be.from_f32(&rng.vec(len, -1.0, 1.0), 1)
        .unwrap_or_else(|e| panic!("alloc: {e}"))
}

const Q8B32: QKind = QKind::Q8 { block: 32 };
const Q8B16: QKind = QKind::Q8 { block: 16 };
const Q4: QKind = QKind::Q4;

fn kind_name(k: QKind) -> &'static str {
    match k {
        QKind::Q8 { block: 16 } => "Q8b16",
        QKind::Q8 { .. } => "Q8b32",
        QKind::Q4 => "Q4",
    }
}

// ---------------------------------------------------------------------------------------------------------
// Timing

struct Timing {
    rec_us: f64,
    gpu_us: f64,
}

/// Records `iters` calls (call i uses matrix i % mats.len()), then syncs; per-call times of both phases.
fn time_calls(
    be: &Backend,
    x: &Tensor,
    y: &mut Tensor,
    mats: &[QMatrix],
    m: usize,
    iters: usize,
) -> Timing {
    let t0 = Instant::now();
    for i in 0..iters {
        qmatmul(be, x.at(0), &mats[i % mats.len()], y.at_mut(0), m)
            .unwrap_or_else(|e| panic!("qmatmul: {e}"));
    }
    let t1 = Instant::now();
    be.sync().unwrap_or_else(|e| panic!("sync: {e}"));
    let t2 = Instant::now();
    Timing {
        rec_us: (t1 - t0).as_secs_f64() * 1e6 / iters as f64,
        gpu_us: (t2 - t1).as_secs_f64() * 1e6 / iters as f64,
    }
}

/// Warms up (pipelines, bind groups, one call per matrix), then sizes a run to about `target_s`
/// seconds (at least one pass over `mats`, at most 20000 calls) and times it.
fn measure(
    be: &Backend,
    x: &Tensor,
    y: &mut Tensor,
    mats: &[QMatrix],
    m: usize,
    target_s: f64,
) -> Timing {
    let warm = time_calls(be, x, y, mats, m, mats.len().max(4));
    let per_call = (warm.rec_us + warm.gpu_us) * 1e-6;
    let iters = ((target_s / per_call) as usize).clamp(mats.len(), 20_000.max(mats.len()));
    time_calls(be, x, y, mats, m, iters)
}

// ---------------------------------------------------------------------------------------------------------
// Sections

fn calls(be: &Backend, footprint: u64) {
    println!(
        "\n== one qmatmul, m = 1: weights streamed (rotating copies over >= {} MiB) and hot ==",
        footprint >> 20
    );
    println!(
        "{:32} {:>9} {:>6} | {:>9} {:>9} {:>8} | {:>9} {:>8}",
        "shape", "weights", "copies", "rec µs", "gpu µs", "GB/s", "hot µs", "GB/s"
    );
    let shapes: [(&str, usize, usize, &[QKind]); 11] = [
        ("SmolLM2 q/o   576x576", 576, 576, &[Q4, Q8B32, Q8B16]),
        ("SmolLM2 k/v   192x576", 192, 576, &[Q4, Q8B32, Q8B16]),
        ("SmolLM2 gate/up 1536x576", 1536, 576, &[Q4, Q8B32, Q8B16]),
        ("SmolLM2 down  576x1536", 576, 1536, &[Q4, Q8B32, Q8B16]),
        ("SmolLM2 head  49152x576", 49152, 576, &[Q8B32]),
        ("Gemma q       1024x640", 1024, 640, &[Q8B32, Q4]),
        ("Gemma k/v     256x640", 256, 640, &[Q8B32, Q4]),
        ("Gemma o       640x1024", 640, 1024, &[Q4, Q8B32]),
        ("Gemma gate/up 2048x640", 2048, 640, &[Q8B32, Q4]),
        ("Gemma down    640x2048", 640, 2048, &[Q8B16, Q4]),
        ("Gemma head    262144x640", 262144, 640, &[Q8B32]),
    ];
    let mut rng = SeedRng::new(1);
    for (name, n, k, kinds) in shapes {
        for &kind in kinds {
            let src = matrix(&mut rng, kind, n, k);
            let first = upload(be, src.clone());
            let bytes = first.weight_bytes();
            let copies = (footprint.div_ceil(bytes) as usize).clamp(1, 4096);
            let mut mats = vec![first];
            mats.extend((1..copies).map(|_| upload(be, src.clone())));
            drop(src);
            let x = tensor(be, &mut rng, k);
            let mut y = be.zeros(n, n).unwrap_or_else(|e| panic!("alloc: {e}"));
            let cold = measure(be, &x, &mut y, &mats, 1, 0.3);
            let hot = measure(be, &x, &mut y, &mats[..1], 1, 0.2);
            let gbs = |us: f64| bytes as f64 / us / 1e3;
            println!(
                "{:26} {:5} {:7.2}M {:>6} | {:9.2} {:9.2} {:8.1} | {:9.2} {:8.1}",
                name,
                kind_name(kind),
                bytes as f64 / (1 << 20) as f64,
                copies,
                cold.rec_us,
                cold.gpu_us,
                gbs(cold.gpu_us),
                hot.gpu_us,
                gbs(hot.gpu_us)
            );
        }
    }
}

/// (name, kind, N, K) in one decode step's order.
type Model = Vec<(&'static str, QKind, usize, usize)>;

fn smollm() -> Model {
    let (h, kv, ff) = (576, 192, 1536);
    let mut v = Vec::new();
    for _ in 0..30 {
        v.extend([
            ("q", Q4, h, h),
            ("k", Q4, kv, h),
            ("v", Q4, kv, h),
            ("o", Q4, h, h),
            ("gate", Q4, ff, h),
            ("up", Q4, ff, h),
            ("down", Q4, h, ff),
        ]);
    }
    v.push(("head", Q8B32, 49152, h));
    v
}

/// Gemma-3-270M as llama.cpp's Q4_K_M lays it out (see the CPU benchmark): q/k/v/gate/up fall back to
/// Q5_0 (Q8_0 for v in the `use_more_bits` layers), o is Q4_K, down is Q6_K in those layers and Q4_K
/// elsewhere; the tied head is Q8_0.
fn gemma() -> Model {
    let (h, q, kv, ff) = (640, 1024, 256, 2048);
    let mut v = Vec::new();
    for l in 0..18 {
        let more_bits = !(2..16).contains(&l) || (l - 2) % 3 == 2;
        v.extend([
            ("q", Q8B32, q, h),
            ("k", Q8B32, kv, h),
            ("v", Q8B32, kv, h),
            ("o", Q4, h, q),
            ("gate", Q8B32, ff, h),
            ("up", Q8B32, ff, h),
            ("down", if more_bits { Q8B16 } else { Q4 }, h, ff),
        ]);
    }
    v.push(("head", Q8B32, 262144, h));
    v
}

/// Whole decode steps: every matrix of the model once with m = 1, in order, each with its own weights.
fn step(be: &Backend, name: &str, model: &Model) {
    println!("\n== decode step, matmuls only: {name} ==");
    let mut rng = SeedRng::new(2);
    let mats: Vec<QMatrix> = model
        .iter()
        .map(|&(_, kind, n, k)| upload(be, matrix(&mut rng, kind, n, k)))
        .collect();
    let bytes: u64 = mats.iter().map(|m| m.weight_bytes()).sum();
    let kmax = model.iter().map(|m| m.3).max().unwrap_or(1);
    let nmax = model.iter().map(|m| m.2).max().unwrap_or(1);
    let x = tensor(be, &mut rng, kmax);
    let mut y = be.zeros(nmax, 1).unwrap_or_else(|e| panic!("alloc: {e}"));
    let run = |y: &mut Tensor, steps: usize| -> Timing {
        let t0 = Instant::now();
        for _ in 0..steps {
            for w in &mats {
                qmatmul(be, x.at(0), w, y.at_mut(0), 1).unwrap_or_else(|e| panic!("qmatmul: {e}"));
            }
        }
        let t1 = Instant::now();
        be.sync().unwrap_or_else(|e| panic!("sync: {e}"));
        let t2 = Instant::now();
        Timing {
            rec_us: (t1 - t0).as_secs_f64() * 1e6 / steps as f64,
            gpu_us: (t2 - t1).as_secs_f64() * 1e6 / steps as f64,
        }
    };
    let warm = run(&mut y, 1);
    let steps = ((0.5e6 / (warm.rec_us + warm.gpu_us)) as usize).clamp(1, 50);
    let t = run(&mut y, steps);
    println!(
        "{} matmuls, {:.1} MiB of weights; {steps} steps: rec {:.0} µs/step, gpu {:.0} µs/step = {:.1} GB/s, \
         {:.1} tok/s (matmuls only, gpu phase)",
        mats.len(),
        bytes as f64 / (1 << 20) as f64,
        t.rec_us,
        t.gpu_us,
        bytes as f64 / t.gpu_us / 1e3,
        1e6 / t.gpu_us
    );
}

/// Prompt processing: m rows of x per call (the kernel reads the weights once per 8 rows).
fn prompt(be: &Backend) {
    println!("\n== prompt processing (m > 1), weights hot ==");
    let mut rng = SeedRng::new(3);
    for (name, kind, n, k) in [
        ("SmolLM2 gate 1536x576", Q4, 1536, 576),
        ("Gemma gate 2048x640", Q8B32, 2048, 640),
    ] {
        let mats = vec![upload(be, matrix(&mut rng, kind, n, k))];
        for m in [1, 8, 64] {
            let x = tensor(be, &mut rng, m * k);
            let mut y = be.zeros(m * n, n).unwrap_or_else(|e| panic!("alloc: {e}"));
            let t = measure(be, &x, &mut y, &mats, m, 0.2);
            println!(
                "{name:24} {:5} m = {m:3}: gpu {:9.2} µs/call = {:8.1} GFLOP/s",
                kind_name(kind),
                t.gpu_us,
                2.0 * (m * n * k) as f64 / t.gpu_us / 1e3
            );
        }
    }
}
