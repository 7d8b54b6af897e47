//! Batch-1 decode speed of the CPU quantized matmuls on the real model shapes, against the machine's
//! memory bandwidth.
//!
//! `cargo bench -p tinygpt-kernels --bench quant_matmul_cpu [-- SECTION...]` with sections `bw`, `calls`,
//! `kernel`, `smollm`, `gemma`, `prompt`, `prompt-gemma` (default: all; `QMM_ISA=avx2` runs the prompt
//! sections on AVX2). `QMM_QUICK=1` runs only the first decode variant
//! (parallel inside a pool).
//!
//! A "decode step" runs every weight matrix of the model once with m = 1, layer by layer, each layer with
//! its own weights (as in a real model: nothing is reused from cache between steps, the whole model
//! streams from DRAM), then the tied output head. tok/s here counts only these matmuls — attention,
//! norms and the rest of a real step come on top. GB/s is weight bytes in this crate's layouts (f32
//! scales/mins) per second; the GGUF bytes column is what llama.cpp streams for the same model.
//! Steps are timed one by one; medians are reported because other processes share the 2 cores.

use std::hint::black_box;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use tinygpt_kernels::ops::matmul::quant::cpu::{
    CpuIsa, QmmOptions, q4_matmul_nt_with, q8_matmul_nt_with,
};
use tinygpt_kernels::ops::matmul::quant::cpu_int::{
    IntMatrix, IntOptions, int_dot_available, int_matmul,
};
use tinygpt_kernels::quant::{Q4Matrix, Q8Matrix};

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let want = |s: &str| args.is_empty() || args.iter().any(|a| a == s);
    println!(
        "threads: {} (rayon), isa detected: {:?}",
        rayon::current_num_threads(),
        CpuIsa::detected()
    );
    if want("bw") {
        bandwidth();
    }
    if want("kernel") {
        kernel();
    }
    if want("calls") {
        per_call();
    }
    if want("smollm") {
        decode("SmolLM2-135M (Q4_1 layers, Q8_0 head)", &smollm(), 229.0);
    }
    if want("gemma") {
        decode(
            "Gemma-3-270M (Q4_K_M: Q5_0/Q8_0 -> Q8b32, Q4_K -> Q4, Q6_K -> Q8b16)",
            &gemma(),
            107.0,
        );
    }
    if want("prompt") {
        prompt("SmolLM2-135M", smollm());
    }
    if want("prompt-gemma") {
        prompt("Gemma-3-270M", gemma());
    }
}

// ---------------------------------------------------------------------------------------------------------
// Weights

enum W {
    Q8(Q8Matrix),
    Q4(Q4Matrix),
}

impl W {
    fn rows(&self) -> usize {
        match self {
            W::Q8(w) => w.rows,
            W::Q4(w) => w.rows,
        }
    }
    fn cols(&self) -> usize {
        match self {
            W::Q8(w) => w.cols,
            W::Q4(w) => w.cols,
        }
    }
    /// Bytes in this crate's layout.
    fn bytes(&self) -> usize {
        match self {
            W::Q8(w) => w.quants.len() * 4 + w.scales.len() * 4,
            W::Q4(w) => w.quants.len() * 4 + w.scales.len() * 4 + w.mins.len() * 4,
        }
    }
    fn run(&self, x: &[f32], y: &mut [f32], m: usize, opts: QmmOptions) {
        let n = self.rows();
        match self {
            W::Q8(w) => q8_matmul_nt_with(x, w, m, 0..n, y, n, opts),
            W::Q4(w) => q4_matmul_nt_with(x, w, m, 0..n, y, n, opts),
        }
    }
}

/// GGUF block types, for the GGUF-bytes column and to pick our layout.
#[derive(Clone, Copy)]
enum Gguf {
    Q4_1,
    Q4K,
    Q5_0,
    Q6K,
    Q8_0,
}

impl Gguf {
    /// Bytes per weight in the GGUF file.
    fn bytes_per_weight(self) -> f64 {
        match self {
            Gguf::Q4_1 => 20.0 / 32.0,
            Gguf::Q4K => 144.0 / 256.0,
            Gguf::Q5_0 => 22.0 / 32.0,
            Gguf::Q6K => 210.0 / 256.0,
            Gguf::Q8_0 => 34.0 / 32.0,
        }
    }
}

struct Mat {
    name: &'static str,
    gguf: Gguf,
    w: W,
}

fn make(rng: &mut ChaCha8Rng, name: &'static str, gguf: Gguf, n: usize, k: usize) -> Mat {
    let mut quants = vec![
        0u32;
        n * k
            / if matches!(gguf, Gguf::Q4_1 | Gguf::Q4K) {
                8
            } else {
                4
            }
    ];
    rng.fill(&mut quants[..]);
    let mut sc =
        |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-0.02..0.02)).collect() };
    let w = match gguf {
        Gguf::Q4_1 | Gguf::Q4K => W::Q4(Q4Matrix {
            rows: n,
            cols: k,
            scales: sc(n * k / 32),
            mins: sc(n * k / 32),
            quants,
        }),
        Gguf::Q5_0 | Gguf::Q8_0 => W::Q8(Q8Matrix {
            rows: n,
            cols: k,
            block: 32,
            scales: sc(n * k / 32),
            quants,
        }),
        Gguf::Q6K => W::Q8(Q8Matrix {
            rows: n,
            cols: k,
            block: 16,
            scales: sc(n * k / 16),
            quants,
        }),
    };
    Mat { name, gguf, w }
}

/// The matrices of one decode step, in execution order.
type Model = Vec<Mat>;

fn smollm() -> Model {
    let mut rng = ChaCha8Rng::seed_from_u64(135);
    let (h, kv, ff) = (576, 192, 1536);
    let mut v = Vec::new();
    for _ in 0..30 {
        v.push(make(&mut rng, "q", Gguf::Q4_1, h, h));
        v.push(make(&mut rng, "k", Gguf::Q4_1, kv, h));
        v.push(make(&mut rng, "v", Gguf::Q4_1, kv, h));
        v.push(make(&mut rng, "o", Gguf::Q4_1, h, h));
        v.push(make(&mut rng, "gate", Gguf::Q4_1, ff, h));
        v.push(make(&mut rng, "up", Gguf::Q4_1, ff, h));
        v.push(make(&mut rng, "down", Gguf::Q4_1, h, ff));
    }
    v.push(make(&mut rng, "head", Gguf::Q8_0, 49152, h));
    v
}

/// Gemma-3-270M as llama.cpp's Q4_K_M lays it out: rows of 640 are not a multiple of 256, so the K-quants
/// fall back (Q4_K -> Q5_0, Q6_K -> Q8_0) for q/k/v/gate/up; o (K = 1024) is Q4_K; ffn_down (K = 2048) is
/// Q6_K in the `use_more_bits` layers (0, 1, 4, 7, 10, 13, 16, 17) and Q4_K elsewhere.
fn gemma() -> Model {
    let mut rng = ChaCha8Rng::seed_from_u64(270);
    let (h, q, kv, ff) = (640, 4 * 256, 256, 2048);
    let mut v = Vec::new();
    for l in 0..18 {
        let more_bits = !(2..16).contains(&l) || (l - 2) % 3 == 2;
        v.push(make(&mut rng, "q", Gguf::Q5_0, q, h));
        v.push(make(&mut rng, "k", Gguf::Q5_0, kv, h));
        v.push(make(
            &mut rng,
            "v",
            if more_bits { Gguf::Q8_0 } else { Gguf::Q5_0 },
            kv,
            h,
        ));
        v.push(make(&mut rng, "o", Gguf::Q4K, h, q));
        v.push(make(&mut rng, "gate", Gguf::Q5_0, ff, h));
        v.push(make(&mut rng, "up", Gguf::Q5_0, ff, h));
        v.push(make(
            &mut rng,
            "down",
            if more_bits { Gguf::Q6K } else { Gguf::Q4K },
            h,
            ff,
        ));
    }
    v.push(make(&mut rng, "head", Gguf::Q8_0, 262144, h));
    v
}

// ---------------------------------------------------------------------------------------------------------
// Measurements

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Memory bandwidth: sum of a 512 MiB buffer (1 thread and all threads) and a 256 MiB memcpy.
fn bandwidth() {
    println!("\n== memory bandwidth (the ceiling for batch-1 decode) ==");
    let n = 512 << 20 >> 2;
    let buf: Vec<f32> = (0..n).map(|i| (i & 7) as f32).collect();
    let sum1 = |s: &[f32]| -> f32 {
        // 16 independent lanes so the loop is bandwidth-bound, not add-latency-bound.
        let mut acc = [0f32; 16];
        for c in s.chunks_exact(16) {
            for l in 0..16 {
                acc[l] += c[l];
            }
        }
        acc.iter().sum()
    };
    let bytes = (n * 4) as f64;
    let mut t1 = Vec::new();
    let mut tn = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        black_box(sum1(black_box(&buf)));
        t1.push(bytes / secs(t.elapsed()) / 1e9);
        let t = Instant::now();
        let s: f32 = buf
            .par_chunks(buf.len().div_ceil(rayon::current_num_threads()))
            .map(sum1)
            .sum();
        black_box(s);
        tn.push(bytes / secs(t.elapsed()) / 1e9);
    }
    let (b1, bn) = (
        t1.iter().cloned().fold(0.0, f64::max),
        tn.iter().cloned().fold(0.0, f64::max),
    );
    println!(
        "read 512 MiB, 1 thread:   median {:5.1} GB/s, best {b1:5.1}",
        median(&mut t1)
    );
    println!(
        "read 512 MiB, {} threads:  median {:5.1} GB/s, best {bn:5.1}",
        rayon::current_num_threads(),
        median(&mut tn)
    );
    let src = vec![1u8; 256 << 20];
    let mut dst = vec![0u8; 256 << 20];
    let mut tc = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&dst);
        // read + write traffic
        tc.push(2.0 * src.len() as f64 / secs(t.elapsed()) / 1e9);
    }
    println!(
        "memcpy 256 MiB, 1 thread: median {:5.1} GB/s (read+write)",
        median(&mut tc)
    );
}

/// Kernel throughput on one thread, weights hot in L2 (best of many runs: the compute ceiling per core).
fn kernel() {
    for rows in [1usize, 8] {
        println!(
            "\n== kernel throughput, 1 thread, m = {rows}, weights L2-hot (best of {} calls) ==",
            3000 / rows
        );
        let mut rng = ChaCha8Rng::seed_from_u64(10);
        for (name, gguf, n, k) in [
            ("Q4 256x576", Gguf::Q4_1, 256, 576),
            ("Q4 128x2048", Gguf::Q4_1, 128, 2048),
            ("Q8b32 256x576", Gguf::Q8_0, 256, 576),
            ("Q8b32 128x2048", Gguf::Q8_0, 128, 2048),
            ("Q8b16 128x2048", Gguf::Q6K, 128, 2048),
            ("Q8b16 256x576", Gguf::Q6K, 256, 576),
        ] {
            let m = make(&mut rng, name, gguf, n, k);
            let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut y = vec![0f32; rows * n];
            let mut line = format!("{name:15} ({:3} KiB):", m.w.bytes() / 1024);
            for isa in [CpuIsa::Avx512, CpuIsa::Avx2Fma, CpuIsa::Scalar] {
                if !isa.is_available() {
                    continue;
                }
                let opts = QmmOptions {
                    isa,
                    parallel: false,
                    ..QmmOptions::default()
                };
                let best = (0..3000 / rows)
                    .map(|_| {
                        let t = Instant::now();
                        m.w.run(&x, &mut y, rows, opts);
                        secs(t.elapsed())
                    })
                    .fold(f64::MAX, f64::min);
                line += &if rows == 1 {
                    format!(
                        " {isa:?} {:6.2} µs = {:5.2} weights/ns, {:5.1} GB/s |",
                        best * 1e6,
                        (n * k) as f64 / best / 1e9,
                        m.w.bytes() as f64 / best / 1e9
                    )
                } else {
                    format!(
                        " {isa:?} {:7.2} µs = {:5.1} GFLOP/s |",
                        best * 1e6,
                        2.0 * (rows * n * k) as f64 / best / 1e9
                    )
                };
            }
            println!("{line}");
        }
    }
}

/// The cost of one small call, weights hot in cache: what ~200 calls per token pay besides streaming.
fn per_call() {
    println!("\n== per-call cost, m = 1, weights cache-hot (median of 2000 calls) ==");
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    for (name, gguf, n, k) in [
        ("k/v 192x576 Q4", Gguf::Q4_1, 192, 576),
        ("q 576x576 Q4", Gguf::Q4_1, 576, 576),
        ("gate 1536x576 Q4", Gguf::Q4_1, 1536, 576),
        ("q 1024x640 Q8b32", Gguf::Q5_0, 1024, 640),
    ] {
        let m = make(&mut rng, name, gguf, n, k);
        let x: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut y = vec![0f32; n];
        let time = |opts: QmmOptions, y: &mut [f32]| -> f64 {
            let mut v: Vec<f64> = (0..2000)
                .map(|_| {
                    let t = Instant::now();
                    m.w.run(&x, y, 1, opts);
                    secs(t.elapsed()) * 1e6
                })
                .collect();
            median(&mut v)
        };
        let auto = QmmOptions::default();
        let single = QmmOptions {
            parallel: false,
            ..auto
        };
        let one = time(single, &mut y);
        let par_out = time(auto, &mut y);
        let par_in = pool.install(|| time(auto, &mut y));
        let scalar = time(
            QmmOptions {
                isa: CpuIsa::Scalar,
                parallel: false,
                ..QmmOptions::default()
            },
            &mut y,
        );
        println!(
            "{name:18} ({:4} KiB): 1 thread {one:6.2} µs | parallel from outside the pool {par_out:6.2} µs | \
             from inside pool.install {par_in:6.2} µs | scalar 1 thread {scalar:6.2} µs",
            m.w.bytes() / 1024
        );
    }
}

/// Batched decode steps: m sequences' rows through every matrix, head included, each row computed as it
/// is alone (bit-identical to a call of its own), as `tinygpt serve` and `bench llm --parallel` run them:
/// on the integer-dot kernels (the `int-dot` path) where this CPU has them, then on the f32 kernels.
fn batched(name: &str, model: &Model, pool: &rayon::ThreadPool) {
    let shapes: Vec<(usize, usize)> = model.iter().map(|m| (m.w.rows(), m.w.cols())).collect();
    if int_dot_available() {
        println!(
            "\n== batched decode on the integer-dot kernels: all {name} matrices (head included) =="
        );
        let packed: Vec<IntMatrix> = model
            .iter()
            .map(|m| match &m.w {
                W::Q8(w) => IntMatrix::from_q8(w),
                W::Q4(w) => IntMatrix::from_q4(w),
            })
            .collect::<Option<_>>()
            .expect("every matrix packs");
        steps_per_m(&shapes, &[1, 4, 8, 16, 64], |m| {
            median_of_passes(&shapes, m, pool, |i, x, y| {
                int_matmul(x, &packed[i], y, m, IntOptions::default())
            })
        });
    } else {
        println!("\n(no AVX-512 VNNI here: the integer-dot kernels are not timed)");
    }
    println!("\n== batched decode: all {name} matrices (head included), m rows as alone ==");
    let opts = QmmOptions {
        alone: true,
        ..QmmOptions::default()
    };
    steps_per_m(&shapes, &[1, 4, 8, 16], |m| {
        median_pass(model, m, opts, pool)
    });
}

/// One line per row count m: the step time `step(m)` gives, as tokens/s and GFLOP/s over the matrices
/// of `shapes` (N, K).
fn steps_per_m(shapes: &[(usize, usize)], ms: &[usize], step: impl Fn(usize) -> f64) {
    let macs: usize = shapes.iter().map(|(n, k)| n * k).sum();
    for &m in ms {
        let t = step(m);
        println!(
            "m = {m:2}: {:7.2} ms a step, {:6.1} tokens/s, {:6.1} GFLOP/s",
            t * 1e3,
            m as f64 / t,
            2.0 * (macs * m) as f64 / t / 1e9
        );
    }
}

/// Median of 7 passes of m activation rows through every matrix of `model` (inside `pool`).
fn median_pass(model: &Model, m: usize, opts: QmmOptions, pool: &rayon::ThreadPool) -> f64 {
    let shapes: Vec<(usize, usize)> = model.iter().map(|w| (w.w.rows(), w.w.cols())).collect();
    median_of_passes(&shapes, m, pool, |i, x, y| model[i].w.run(x, y, m, opts))
}

/// Median of 7 passes of m activation rows through matrices of `shapes` (N, K) in order, matrix i
/// multiplied by `run(i, x, y)` (inside `pool`).
fn median_of_passes(
    shapes: &[(usize, usize)],
    m: usize,
    pool: &rayon::ThreadPool,
    run: impl Fn(usize, &[f32], &mut [f32]) + Sync,
) -> f64 {
    let kmax = shapes.iter().map(|s| s.1).max().unwrap();
    let nmax = shapes.iter().map(|s| s.0).max().unwrap();
    let x: Vec<f32> = (0..m * kmax)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut y = vec![0f32; m * nmax];
    let mut v: Vec<f64> = (0..7)
        .map(|_| {
            pool.install(|| {
                let t = Instant::now();
                for (i, &(n, k)) in shapes.iter().enumerate() {
                    run(i, &x[..m * k], &mut y[..m * n]);
                }
                secs(t.elapsed())
            })
        })
        .collect();
    median(&mut v)
}

/// Runs decode steps; returns the median step time and the median time per matrix name.
fn steps(model: &Model, opts: QmmOptions, n_steps: usize) -> (f64, f64, Vec<(&'static str, f64)>) {
    let kmax = model.iter().map(|m| m.w.cols()).max().unwrap();
    let nmax = model.iter().map(|m| m.w.rows()).max().unwrap();
    let x: Vec<f32> = (0..kmax)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut y = vec![0f32; nmax];
    let mut names: Vec<&'static str> = Vec::new();
    for m in model {
        if !names.contains(&m.name) {
            names.push(m.name);
        }
    }
    let mut per: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let mut total = Vec::new();
    for step in 0..n_steps + 2 {
        let mut acc = vec![0.0; names.len()];
        let t0 = Instant::now();
        for m in model {
            let t = Instant::now();
            let (n, k) = (m.w.rows(), m.w.cols());
            m.w.run(&x[..k], &mut y[..n], 1, opts);
            acc[names.iter().position(|s| *s == m.name).unwrap()] += secs(t.elapsed());
        }
        let dt = secs(t0.elapsed());
        black_box(&y);
        if step >= 2 {
            // the first two steps warm up page tables and the pool
            total.push(dt);
            for (p, a) in per.iter_mut().zip(acc) {
                p.push(a);
            }
        }
    }
    let med = median(&mut total);
    let best = total.iter().cloned().fold(f64::MAX, f64::min);
    (
        med,
        best,
        names
            .into_iter()
            .zip(per.iter_mut().map(|v| median(v)))
            .collect(),
    )
}

fn decode(title: &str, model: &Model, llama_tok_s: f64) {
    println!("\n== decode step: {title} ==");
    let bytes: usize = model.iter().map(|m| m.w.bytes()).sum();
    let gguf: f64 = model
        .iter()
        .map(|m| (m.w.rows() * m.w.cols()) as f64 * m.gguf.bytes_per_weight())
        .sum();
    println!(
        "{} matmuls, weights {:.1} MB in our layout ({:.1} MB in GGUF); llama.cpp {llama_tok_s} tok/s = {:.1} GB/s",
        model.len(),
        bytes as f64 / 1e6,
        gguf / 1e6,
        gguf * llama_tok_s / 1e9
    );
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    let auto = QmmOptions::default();
    let runs: Vec<(&str, QmmOptions, bool)> = vec![
        ("parallel, inside pool.install", auto, true),
        ("parallel, from outside the pool", auto, false),
        (
            "1 thread",
            QmmOptions {
                parallel: false,
                ..auto
            },
            false,
        ),
        (
            "AVX2 path, parallel, in pool",
            QmmOptions {
                isa: CpuIsa::Avx2Fma,
                ..auto
            },
            true,
        ),
        (
            "scalar path, parallel, in pool",
            QmmOptions {
                isa: CpuIsa::Scalar,
                ..auto
            },
            true,
        ),
    ];
    let quick = std::env::var("QMM_QUICK").is_ok();
    for (label, opts, inside) in runs.into_iter().take(if quick { 1 } else { usize::MAX }) {
        let n_steps = if opts.isa == CpuIsa::Scalar { 8 } else { 40 };
        let (t, best, per) = if inside {
            pool.install(|| steps(model, opts, n_steps))
        } else {
            steps(model, opts, n_steps)
        };
        let sum_kinds: f64 = per.iter().map(|(_, s)| s).sum();
        println!(
            "{label:32}: median step {:7.3} ms = {:6.1} tok/s ({:4.2}x llama.cpp), {:5.1} GB/s | best step {:7.3} ms = \
             {:6.1} tok/s ({:4.2}x), {:5.1} GB/s | Σ per-kind medians {:6.3} ms",
            t * 1e3,
            1.0 / t,
            1.0 / t / llama_tok_s,
            bytes as f64 / t / 1e9,
            best * 1e3,
            1.0 / best,
            1.0 / best / llama_tok_s,
            bytes as f64 / best / 1e9,
            sum_kinds * 1e3
        );
        let detail: Vec<String> = per
            .iter()
            .map(|(name, s)| {
                let b: usize = model
                    .iter()
                    .filter(|m| m.name == *name)
                    .map(|m| m.w.bytes())
                    .sum();
                format!("{name} {:.2} ms {:.1} GB/s", s * 1e3, b as f64 / s / 1e9)
            })
            .collect();
        println!("{:34}{}", "", detail.join(" | "));
    }
}

/// Prompt processing (m > 1) over one model's layers (not its head).
fn prompt(name: &str, model: Model) {
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    batched(name, &model, &pool);
    println!("\n== prompt processing: all {name} layers (no head), m tokens at once ==");
    let model: Model = model.into_iter().filter(|m| m.name != "head").collect();
    let macs: usize = model.iter().map(|m| m.w.rows() * m.w.cols()).sum();
    // The row kernels at every m (a group limit keeps a call off the GEMM path), then the default choice.
    // QMM_ISA=avx2 or scalar runs both on that instruction set instead of the detected one.
    let isa = match std::env::var("QMM_ISA").as_deref() {
        Ok("avx2") => CpuIsa::Avx2Fma,
        Ok("scalar") => CpuIsa::Scalar,
        _ => CpuIsa::detected(),
    };
    println!("instruction set: {isa:?}");
    let default = QmmOptions {
        isa,
        ..QmmOptions::default()
    };
    let rows_only = QmmOptions {
        max_group: Some(usize::MAX),
        ..default
    };
    for (what, opts, ms) in [
        (
            "row kernels",
            rows_only,
            &[1usize, 4, 16, 32, 64, 128, 256][..],
        ),
        (
            "default (GEMM from m = GEMM_MIN_ROWS)",
            default,
            &[32, 64, 128, 256][..],
        ),
    ] {
        println!("{what}:");
        for &m in ms {
            let t = median_pass(&model, m, opts, &pool);
            println!(
                "m = {m:3}: {:8.2} ms, {:7.1} tokens/s, {:6.1} GFLOP/s",
                t * 1e3,
                m as f64 / t,
                2.0 * (macs * m) as f64 / t / 1e9
            );
        }
    }
}
