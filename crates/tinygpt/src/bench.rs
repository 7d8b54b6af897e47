//! `tinygpt bench`: per-op throughput on the selected backend, and training throughput.
//! Benchmarks measure; they never assert (the tests do that).

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::time::Instant;
use tinygpt_kernels::gate::pills;
use tinygpt_kernels::ops::matmul::{
    Causal, Choice, Gemm, Kernel, MixedTile, TILE_LARGE, TILE_MEDIUM, TILE_SMALL, TILE_TALL, Tile,
    choose, f16_operands_suit, packed_len,
};
use tinygpt_kernels::rng::SeedRng;
use tinygpt_kernels::{Backend, PathId, PathSet, ops};
use tinygpt_models::gpt::{GptConfig, Layout, OptimConfig, Trainer};

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Per-op throughput (GFLOP/s, GB/s).
    Ops(OpsArgs),
    /// Training throughput of a GPT config on random tokens (tokens/s, ms/iter, submits per step).
    Train(TrainBenchArgs),
    /// Batch-1 decode and prompt throughput of a GGUF model (a file, or a random one of a real shape).
    Llm(LlmBenchArgs),
}

#[derive(Args, Debug)]
pub struct LlmBenchArgs {
    /// The GGUF file to time.
    pub model: Option<std::path::PathBuf>,
    /// Time a random-weight model of this shape instead (speed does not depend on values).
    #[arg(long, conflicts_with = "model")]
    pub synthetic: Option<crate::synthetic::Preset>,
    /// With --synthetic: the block format of the layer matrices (the embedding stays Q8_0).
    #[arg(long, requires = "synthetic", default_value = "q8_0")]
    pub synthetic_quant: crate::synthetic::Quant,
    /// Prompt tokens (one batched pass).
    #[arg(long, default_value_t = 128)]
    pub prompt: usize,
    /// Tokens to decode one at a time.
    #[arg(short = 'n', long, default_value_t = 64)]
    pub n: usize,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Then time every kernel of the prompt and of the decode passes on the device (GPU adapters with
    /// timestamp queries inside passes) and print where the time goes.
    #[arg(long)]
    pub profile: bool,
    /// With --synthetic: also write the model to this GGUF file (llama.cpp's `llama-bench` loads it), and
    /// stop there.
    #[arg(long, requires = "synthetic")]
    pub save: Option<std::path::PathBuf>,
    /// Also decode this many sequences together (as `tinygpt serve` does its requests: one pass per
    /// step for all, each with its own cache; the picks read back every step) and report the
    /// aggregate tokens per second.
    #[arg(long)]
    pub parallel: Option<usize>,
}

#[derive(Args, Debug)]
pub struct OpsArgs {
    /// Also time every GEMM tile configuration on the big products, and every tensor-core tile shape
    /// where the adapter has cooperative matrices (tuning); `--tiles f32` or `--tiles tensor-cores`
    /// sweeps one kind only.
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "all")]
    pub tiles: Option<TileSweep>,
    /// Largest square GEMM to time (default: 4096 on a GPU, 512 on the CPU or a software adapter).
    #[arg(long)]
    pub max_size: Option<usize>,
}

/// Which kernels' tile shapes `bench ops --tiles` times.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileSweep {
    All,
    F32,
    TensorCores,
}

#[derive(Args, Debug)]
pub struct TrainBenchArgs {
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    #[arg(long, default_value_t = 256)]
    pub block_size: usize,
    #[arg(long, default_value_t = 6)]
    pub n_layer: usize,
    #[arg(long, default_value_t = 6)]
    pub n_head: usize,
    #[arg(long, default_value_t = 384)]
    pub n_embd: usize,
    #[arg(long, default_value_t = 0.2)]
    pub dropout: f32,
    /// Vocabulary size (default: the bundled text's, which the training gate trains on).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Forward products from f16-stored weights (when the f16-storage path passed its gate).
    #[arg(long)]
    pub f16_forward: bool,
    /// Then time every kernel of one training step on the device (GPU adapters with timestamp queries
    /// inside passes) and print where the time goes.
    #[arg(long)]
    pub profile: bool,
}

pub fn run(be: &Backend, gate: &crate::gates::GateArgs, cmd: &BenchCmd) -> Result<()> {
    println!("backend: {}", be.describe());
    let t = Instant::now();
    // `bench llm` runs the quantized products, which the CPU backend has a fast path for; training
    // and the op benchmarks only gate a GPU's paths.
    let gated = match cmd {
        BenchCmd::Llm(_) => crate::gates::gate_ops(be, gate, Vec::new())?,
        _ => crate::gates::prepare_ops(be, gate, Vec::new())?,
    };
    if let Some(g) = &gated {
        println!(
            "gates: {:.1} ms ({}) · {}",
            t.elapsed().as_secs_f64() * 1e3,
            if g.summary.all_cached() {
                "warm cache"
            } else {
                "cold"
            },
            pills(g.paths)
        );
    }
    let paths = gated.map_or(PathSet::F32, |g| g.paths);
    match cmd {
        BenchCmd::Ops(a) => ops_bench(be, a),
        BenchCmd::Train(a) => train_bench(be, gate, a, paths),
        BenchCmd::Llm(a) => llm_bench(be, a, paths, gate),
    }
}

/// The training gate of the benchmark's model, on the bundled text (whose vocabulary its default
/// size matches): the tensor-core training path is timed only where it passed.
#[allow(clippy::too_many_arguments)]
fn train_gate(
    be: &Backend,
    gate: &crate::gates::GateArgs,
    data: &tinygpt_models::gpt::Dataset,
    cfg: &GptConfig,
    batch: usize,
    params: &[f32],
    optim: OptimConfig,
    paths: PathSet,
) -> Result<PathSet> {
    use tinygpt_models::gpt::train_gate::{GATE_EVERY, GATE_STEPS, GateRun};
    if !paths.has(PathId::MixedTraining) {
        return Ok(paths);
    }
    // With another --vocab, the text's ids fold into it (still a stream a model can learn).
    let v = cfg.vocab_size as u32;
    let fold = |(x, y): (Vec<u32>, Vec<u32>)| {
        let f = |t: Vec<u32>| t.into_iter().map(|i| i % v).collect::<Vec<u32>>();
        (f(x), f(y))
    };
    let batch_of = |s: usize| fold(data.batch(false, 1, s as u64, batch, cfg.block_size));
    let lr_of = |s: usize| tinygpt_models::gpt::learning_rate(s, 100, 5000, 1e-3, 1e-4);
    let run = GateRun {
        cfg,
        batch,
        params,
        optim,
        seed: 1,
        steps: GATE_STEPS,
        every: GATE_EVERY,
        batch_of: &batch_of,
        lr_of: &lr_of,
        held_out: fold(data.batch(true, 2, 0, batch, cfg.block_size)),
    };
    crate::gates::prepare_training(be, gate, paths, &run)
}

/// The bundled training text, in sequences of `block` characters.
fn bundled_text(block: usize) -> Result<tinygpt_models::gpt::Dataset> {
    let path = crate::paths::bundled(crate::paths::DEFAULT_DATA);
    let text = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(tinygpt_models::gpt::Dataset::from_bytes(&text, block)?)
}

/// Times `reps` runs of `f` recorded back to back (one submit on the GPU), after one warm-up run.
fn time<F: FnMut() -> Result<()>>(be: &Backend, reps: usize, mut f: F) -> Result<f64> {
    f()?;
    be.sync()?;
    // A GPU that was idle runs a short burst at a fraction of its clocks: keep it busy for a fifth of
    // a second (rounds of `reps` calls) before timing.
    if !slow_device(be) {
        let warm = Instant::now();
        for _ in 0..100 {
            for _ in 0..reps {
                f()?;
            }
            be.sync()?;
            if warm.elapsed().as_secs_f64() > 0.2 {
                break;
            }
        }
    }
    let t = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    be.sync()?;
    Ok(t.elapsed().as_secs_f64() / reps as f64)
}

fn slow_device(be: &Backend) -> bool {
    match be {
        Backend::Cpu(_) => true,
        Backend::Gpu(g) => g.is_software(),
    }
}

fn ops_bench(be: &Backend, a: &OpsArgs) -> Result<()> {
    let slow = slow_device(be);
    let max = a.max_size.unwrap_or(if slow { 512 } else { 4096 });
    let mut rng = SeedRng::new(1);
    println!("\n{:<44} {:>10} {:>12}", "matmul (f32)", "ms", "GFLOP/s");
    let mut shapes: Vec<(String, Gemm)> = Vec::new();
    let mut s = 256;
    while s <= max {
        shapes.push((format!("A·B {s}³"), Gemm::nn(s, s, s)));
        s *= 4;
    }
    if max >= 4096 {
        shapes.push(("A·Bᵀ 4096³".into(), Gemm::nt(4096, 4096, 4096)));
        shapes.push(("Aᵀ·B 4096³".into(), Gemm::tn(4096, 4096, 4096)));
    }
    // The default GPT's training products (batch 64 x block 256 = 16384 tokens, width 384).
    let n = if slow { 1024 } else { 16384 };
    for (name, g) in [
        ("qkv fwd x·Wᵀ", Gemm::nt(n, 1152, 384)),
        ("mlp fwd x·Wᵀ", Gemm::nt(n, 1536, 384)),
        ("mlp-proj fwd x·Wᵀ", Gemm::nt(n, 384, 1536)),
        ("mlp dX = dY·W", Gemm::nn(n, 1536, 384)),
        ("mlp dW = dYᵀ·X", Gemm::tn(1536, 384, n)),
        ("qkv dW = dYᵀ·X", Gemm::tn(1152, 384, n)),
    ] {
        shapes.push((format!("{name} [{n} tok]"), g));
    }
    // Attention's products: a batch of (sequence, head) pairs, 256 positions, 64 wide, with the causal
    // structure training gives them (the kernels skip the masked half; GFLOP/s counts the whole
    // product).
    let pairs = n / 256 * 6;
    let (t, hd) = (256, 64);
    for (name, g, causal) in [
        (
            "attention scores Q·Kᵀ",
            Gemm::nt(t, t, hd).batched([pairs, 1], [t * hd, 0], [t * hd, 0], [t * t, 0]),
            Causal::Output,
        ),
        (
            "attention mix P·V",
            Gemm::nn(t, hd, t).batched([pairs, 1], [t * t, 0], [t * hd, 0], [t * hd, 0]),
            Causal::ALower,
        ),
        (
            "attention dK = dSᵀ·Q",
            Gemm::tn(t, hd, t).batched([pairs, 1], [t * t, 0], [t * hd, 0], [t * hd, 0]),
            Causal::AUpper,
        ),
    ] {
        shapes.push((format!("{name} [{pairs} x {t}]"), g));
        shapes.push((format!("{name}, causal"), g.causal(causal)));
    }
    for (name, g) in &shapes {
        let [ea, eb, ec] = g.extents();
        let mut av = rng.vec(ea, -1.0, 1.0);
        // P·V's P and dSᵀ·Q's dS (each stored t x t) are zero right of the diagonal, as training's are.
        if matches!(g.causal, Causal::ALower | Causal::AUpper) {
            for (i, v) in av.iter_mut().enumerate() {
                let (row, col) = (i % (t * t) / t, i % t);
                if col > row {
                    *v = 0.0;
                }
            }
        }
        let ta = be.from_f32(&av, 1)?;
        let tb = be.from_f32(&rng.vec(eb, -1.0, 1.0), 1)?;
        let mut tc = be.zeros(ec, 1)?;
        let flops = 2.0 * (g.m * g.n * g.k * g.batch[0] * g.batch[1]) as f64;
        let reps = ((2e11 / flops) as usize).clamp(3, 50);
        let reps = if slow { 1 } else { reps };
        // The f32 kernel choice first (its result is the reference), then the tiled kernel on every
        // candidate tile (tuning); where the adapter has cooperative matrices, the training path's
        // tensor-core products (f16 operands, f32 accumulation) as chosen and on every candidate
        // tile, each with its largest error against the f32 result relative to its largest magnitude.
        let mut runs: Vec<Bench> = vec![Bench::F32(None)];
        let sweep = |k: TileSweep| a.tiles.is_some_and(|t| t == TileSweep::All || t == k);
        if sweep(TileSweep::F32) && !slow {
            runs.extend(candidate_tiles().into_iter().map(|t| Bench::F32(Some(t))));
        }
        let coop = be.as_gpu().is_some_and(|g| {
            g.has_feature(tinygpt_kernels::wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        });
        // A tensor-core form as chosen, then (with the sweep) on every candidate tile.
        let tensor_core_runs = |runs: &mut Vec<Bench>, form: fn(Option<MixedTile>) -> Bench| {
            runs.push(form(None));
            if sweep(TileSweep::TensorCores) {
                runs.extend(MixedTile::CANDIDATES.into_iter().map(|t| form(Some(t))));
            }
        };
        if coop {
            tensor_core_runs(&mut runs, Bench::Mixed);
        }
        // The same product with both operands stored as f16 pairs (half the bytes a tile reads).
        let packed = if coop && f16_operands_suit(g) {
            let mut pa = be.zeros(packed_len(ea), 1)?;
            let mut pb = be.zeros(packed_len(eb), 1)?;
            ops::matmul::pack_f16(be, (&ta).into(), (&mut pa).into(), ea)?;
            ops::matmul::pack_f16(be, (&tb).into(), (&mut pb).into(), eb)?;
            tensor_core_runs(&mut runs, Bench::F16);
            Some((pa, pb))
        } else {
            None
        };
        let mixed = PathSet::of(&[PathId::MixedTraining]);
        let mut reference: Option<Vec<f32>> = None;
        for run in runs {
            let label = match run {
                Bench::F32(None) => name.clone(),
                Bench::F32(Some(t)) => format!("  tile {}", t.key()),
                Bench::Mixed(None) => "  tensor cores, f16 operands".to_string(),
                Bench::Mixed(Some(t)) => format!("    tensor-core tile {}", t.key()),
                Bench::F16(None) => "  tensor cores, f16 operands in memory".to_string(),
                Bench::F16(Some(t)) => format!("    f16-operand tile {}", t.key()),
            };
            let timed = time(be, reps, || {
                let c = (&mut tc).into();
                if let (Bench::F16(tile), Some((pa, pb))) = (run, &packed) {
                    let (pa, pb) = (pa.into(), pb.into());
                    return Ok(ops::matmul::matmul_f16_operands(be, pa, pb, c, g, tile)?);
                }
                let choice = match run {
                    Bench::F32(None) => choose(be, (&ta).into(), (&tb).into(), &c, g, PathSet::F32),
                    Bench::F32(Some(tile)) => Choice::forced(
                        Kernel::Tiled {
                            tile,
                            shader_f16: false,
                            direct: false,
                        },
                        PathSet::F32,
                    ),
                    Bench::Mixed(None) => choose(be, (&ta).into(), (&tb).into(), &c, g, mixed),
                    Bench::Mixed(Some(t)) => Choice::forced(Kernel::CoopMixed(t), mixed),
                    Bench::F16(_) => anyhow::bail!("f16 operands were not packed"),
                };
                Ok(ops::matmul::run(
                    be,
                    choice,
                    (&ta).into(),
                    (&tb).into(),
                    c,
                    g,
                )?)
            });
            let ran = report(be, &label, timed, flops, &tc, reference.as_deref())?.is_some();
            if ran && matches!(run, Bench::F32(None)) {
                reference = Some(be.to_vec(&tc)?);
            }
        }
    }

    println!(
        "\n{:<44} {:>10} {:>12}",
        "element-wise / row-wise (f32)", "ms", "GB/s"
    );
    let n = if slow { 1 << 20 } else { 16384 * 384 };
    let x = be.from_f32(&rng.vec(n, -1.0, 1.0), 384)?;
    let y = be.from_f32(&rng.vec(n, -1.0, 1.0), 384)?;
    let mut out = be.zeros(n, 384)?;
    let mut stats = be.zeros(2 * n / 384, 1)?;
    let w = be.from_f32(&vec![1.0; 384], 384)?;
    let reps = if slow { 3 } else { 50 };
    let gb = |bytes: f64, sec: f64| bytes / sec / 1e9;
    let sec = time(be, reps, || {
        Ok(ops::add::add(
            be,
            (&x).into(),
            (&y).into(),
            (&mut out).into(),
            n,
            1.0,
        )?)
    })?;
    println!(
        "{:<44} {:>10.3} {:>12.1}",
        format!("add ({n})"),
        sec * 1e3,
        gb(12.0 * n as f64, sec)
    );
    let sec = time(be, reps, || {
        Ok(ops::gelu::gelu(be, (&x).into(), (&mut out).into(), n)?)
    })?;
    println!(
        "{:<44} {:>10.3} {:>12.1}",
        format!("gelu ({n})"),
        sec * 1e3,
        gb(8.0 * n as f64, sec)
    );
    let shape = ops::norm::NormShape {
        rows: n / 384,
        cols: 384,
        eps: 1e-5,
    };
    let sec = time(be, reps, || {
        Ok(ops::norm::norm_forward(
            be,
            ops::norm::NormKind::Layer,
            (&x).into(),
            (&w).into(),
            (&mut out).into(),
            (&mut stats).into(),
            shape,
        )?)
    })?;
    println!(
        "{:<44} {:>10.3} {:>12.1}",
        format!("layernorm ({} x 384)", n / 384),
        sec * 1e3,
        gb(8.0 * n as f64, sec)
    );
    let mut sm = be.from_f32(&rng.vec(n, -1.0, 1.0), 256)?;
    let sh = ops::softmax::SoftmaxShape::causal(n / 256, 256);
    let sec = time(be, reps, || {
        Ok(ops::softmax::softmax(be, (&mut sm).into(), sh)?)
    })?;
    println!(
        "{:<44} {:>10.3} {:>12.1}",
        format!("causal softmax ({} x 256)", n / 256),
        sec * 1e3,
        gb(8.0 * n as f64, sec)
    );
    decode_ops(be, &mut rng)
}

/// One decode step's ops at the bundled GPT's width (one token row, 384 wide, 256 cached positions):
/// where a token's time goes on a device.
fn decode_ops(be: &Backend, rng: &mut SeedRng) -> Result<()> {
    println!(
        "\n{:<44} {:>10}",
        "decode step ops (one row, 384 wide)", "µs"
    );
    let c = 384;
    let reps = if slow_device(be) { 20 } else { 200 };
    let x = be.from_f32(&rng.vec(4 * c, -1.0, 1.0), c)?;
    let w = be.from_f32(&rng.vec(4 * c * c, -0.1, 0.1), c)?;
    let mut y = be.zeros(4 * c, 4 * c)?;
    let mut stats = be.zeros(2, 1)?;
    let ones = be.from_f32(&vec![1.0; c], c)?;
    let cache = be.from_f32(&rng.vec(256 * 3 * c, -1.0, 1.0), 3 * c)?;
    let report = |name: &str, sec: f64| println!("{name:<44} {:>10.1}", sec * 1e6);
    for (name, n, k) in [
        ("x·Wᵀ 1 x 1536 x 384", 4 * c, c),
        ("x·Wᵀ 1 x 384 x 1536", c, 4 * c),
    ] {
        let sec = time(be, reps, || {
            Ok(ops::matmul::matmul(
                be,
                PathSet::F32,
                x.at(0),
                &w,
                (&mut y).into(),
                &Gemm::nt(1, n, k),
            )?)
        })?;
        report(name, sec);
    }
    let shape = ops::norm::NormShape {
        rows: 1,
        cols: c,
        eps: 1e-5,
    };
    let sec = time(be, reps, || {
        Ok(ops::norm::norm_forward(
            be,
            ops::norm::NormKind::Layer,
            x.at(0),
            ones.at(0),
            (&mut y).into(),
            (&mut stats).into(),
            shape,
        )?)
    })?;
    report("layernorm 1 x 384", sec);
    let d = ops::attention::DecodeShape {
        rows: 1,
        heads: 6,
        kv_heads: 6,
        head_dim: 64,
        ld_q: 3 * c,
        ld_kv: 3 * c,
        ld_o: c,
        q_pos0: 255,
        kv_len: 256,
        window: 0,
        scale: 0.125,
        softcap: 0.0,
    };
    let sec = time(be, reps, || {
        Ok(ops::attention::attend(
            be,
            cache.at(255 * 3 * c),
            cache.at(c),
            cache.at(2 * c),
            (&mut y).into(),
            d,
        )?)
    })?;
    report("attention, 6 heads over 256 positions", sec);
    let sec = time(be, reps, || {
        Ok(ops::gelu::gelu(be, x.at(0), (&mut y).into(), 4 * c)?)
    })?;
    report("gelu 1536", sec);
    let sec = time(be, reps, || {
        Ok(ops::add::add_assign(be, (&mut y).into(), x.at(0), c, 1.0)?)
    })?;
    report("residual add 384", sec);
    Ok(())
}

/// Prints one timed product of `bench ops` (or the error that stopped it): its time and rate, and
/// beside a tensor-core result its largest error against the f32 kernel's (`reference`) relative to
/// the reference's largest magnitude. Returns the time if there is one.
fn report(
    be: &Backend,
    label: &str,
    timed: Result<f64>,
    flops: f64,
    tc: &tinygpt_kernels::Tensor,
    reference: Option<&[f32]>,
) -> Result<Option<f64>> {
    let sec = match timed {
        Ok(sec) => sec,
        Err(e) => {
            println!("{label:<44} {:>10} {e}", "-");
            return Ok(None);
        }
    };
    let rate = format!(
        "{label:<44} {:>10.3} {:>12.1}",
        sec * 1e3,
        flops / sec / 1e9
    );
    match reference {
        Some(want) => {
            let got = be.to_vec(tc)?;
            let top = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = want
                .iter()
                .zip(&got)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let rel = err / top.max(f32::MIN_POSITIVE);
            println!("{rate}   max|err|/max|ref| {rel:.2e}");
        }
        None => println!("{rate}"),
    }
    Ok(Some(sec))
}

/// Tile configurations the tuning sweep tries (those the device cannot run are reported as such).
/// One timing of `bench ops`'s products: the f32 kernel (as chosen, or on a forced tile) or the
/// tensor-core training kernel (as chosen, or on a forced tile shape).
#[derive(Clone, Copy)]
enum Bench {
    F32(Option<Tile>),
    Mixed(Option<MixedTile>),
    /// The tensor-core kernel on operands stored as f16 pairs (as chosen, or on a forced shape).
    F16(Option<MixedTile>),
}

fn candidate_tiles() -> Vec<Tile> {
    let mut v = vec![TILE_LARGE, TILE_TALL, TILE_MEDIUM, TILE_SMALL];
    for (bm, bn, bk, tm, tn) in [
        (128, 128, 16, 8, 8),
        (128, 64, 16, 8, 4),
        (64, 128, 16, 4, 8),
        (64, 64, 32, 4, 4),
        (128, 128, 32, 8, 8),
        (128, 256, 8, 8, 8),
        (256, 128, 8, 8, 8),
        (64, 64, 16, 4, 8),
        (128, 64, 8, 8, 8),
        (64, 128, 8, 8, 8),
    ] {
        let t = Tile { bm, bn, bk, tm, tn };
        if t.is_valid() && !v.contains(&t) {
            v.push(t);
        }
    }
    v
}

fn train_bench(
    be: &Backend,
    gate: &crate::gates::GateArgs,
    a: &TrainBenchArgs,
    paths: PathSet,
) -> Result<()> {
    // The bundled text, read once: for the default vocabulary and for the training gate.
    let text = if a.vocab.is_none() || paths.has(PathId::MixedTraining) {
        Some(bundled_text(a.block_size.max(1))?)
    } else {
        None
    };
    let vocab = a
        .vocab
        .or_else(|| text.as_ref().map(|t| t.vocab.len()))
        .context("--vocab: no vocabulary size")?;
    let cfg = GptConfig {
        vocab_size: vocab,
        block_size: a.block_size,
        n_layer: a.n_layer,
        n_head: a.n_head,
        n_embd: a.n_embd,
        dropout: a.dropout,
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    let params = Layout::new(&cfg).init(&cfg, 1);
    let t0 = Instant::now();
    let optim = OptimConfig {
        f16_forward: a.f16_forward,
        ..OptimConfig::default()
    };
    let paths = match &text {
        Some(data) => train_gate(be, gate, data, &cfg, a.batch, &params, optim, paths)?,
        None => paths,
    };
    let mut tr = Trainer::new(be, &cfg, a.batch, &params, None, optim, paths)?;
    println!(
        "config: {} layers, {} heads, {} wide, block {}, batch {}, dropout {} — {:.2}M parameters (set up in {:.2}s)",
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.block_size,
        a.batch,
        cfg.dropout,
        cfg.num_params() as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    let mut rng = SeedRng::new(2);
    let tokens = a.batch * cfg.block_size;
    let mut batch = || {
        let x: Vec<u32> = (0..tokens)
            .map(|_| rng.below(cfg.vocab_size) as u32)
            .collect();
        let y: Vec<u32> = (0..tokens)
            .map(|_| rng.below(cfg.vocab_size) as u32)
            .collect();
        (x, y)
    };
    for _ in 0..3 {
        let (x, y) = batch();
        tr.train_step(be, &x, &y, 1e-3, 1)?;
    }
    be.sync()?;
    let before = be.as_gpu().map(|g| g.counters());
    let t = Instant::now();
    for _ in 0..a.iters {
        let (x, y) = batch();
        tr.train_step(be, &x, &y, 1e-3, 1)?;
    }
    be.sync()?;
    let sec = t.elapsed().as_secs_f64() / a.iters as f64;
    let after = be.as_gpu().map(|g| g.counters());
    let loss = tr.last_loss(be)?;
    println!(
        "{:.2} ms/iter, {:.0} tokens/s (last loss {loss:.4})",
        sec * 1e3,
        tokens as f64 / sec
    );
    if let (Some(b), Some(c)) = (before, after) {
        println!(
            "per step: {:.1} submits, {:.1} dispatches, {:.1} readbacks",
            (c.submits - b.submits) as f64 / a.iters as f64,
            (c.dispatches - b.dispatches) as f64 / a.iters as f64,
            (c.readbacks - b.readbacks) as f64 / a.iters as f64
        );
    }
    if let (true, Some(g)) = (a.profile, be.as_gpu()) {
        g.start_profiling()?;
        for _ in 0..3 {
            let (x, y) = batch();
            tr.train_step(be, &x, &y, 1e-3, 1)?;
        }
        print_profile(&g.profile()?, "training step", 3);
    }
    Ok(())
}

fn llm_bench(
    be: &Backend,
    a: &LlmBenchArgs,
    paths: PathSet,
    gate: &crate::gates::GateArgs,
) -> Result<()> {
    let drift_check = gate.drift_check;
    use tinygpt_formats::GgufFile;
    use tinygpt_models::llm::{DriftGuard, Llm, LoadOptions};
    let t0 = Instant::now();
    let file = match (&a.model, a.synthetic) {
        (Some(p), _) => GgufFile::open(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?,
        (None, Some(s)) => {
            let bytes = crate::synthetic::gguf(s, a.synthetic_quant, 7)?;
            if let Some(p) = &a.save {
                // Whole or not at all: a temp name, then a rename.
                let tmp = p.with_extension("gguf.tmp");
                std::fs::write(&tmp, &bytes)
                    .and_then(|_| std::fs::rename(&tmp, p))
                    .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", p.display()))?;
                println!("wrote {} ({} MB)", p.display(), bytes.len() / 1_000_000);
                return Ok(());
            }
            GgufFile::from_bytes(bytes)?
        }
        (None, None) => anyhow::bail!("give a GGUF file or --synthetic smollm2-135m|gemma3-270m"),
    };
    let made = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let par = a.parallel.unwrap_or(1).max(1);
    let opts = LoadOptions {
        context: Some((a.prompt + a.n + 8).max(64)),
        paths,
        parallel: par,
        sequences: if par > 1 { par } else { 0 },
        batch: LoadOptions::default().batch.max(par),
    };
    if par > 1 {
        let cfg = tinygpt_models::llm::LlmConfig::from_gguf(&file)?;
        let ctx = opts.context.unwrap_or(cfg.train_context);
        crate::llm_common::check_cache_memory(be, &cfg, ctx, par, "--parallel, --prompt or -n")?;
    }
    let mut llm = Llm::from_gguf(be, &file, &opts, &mut |_| {})?;
    let cfg = llm.config().clone();
    println!(
        "model: {} ({}, {} layers, {} wide, vocabulary {}) · {:.0} MB of weights · file {:.1}s, load {:.2}s",
        if cfg.name.is_empty() {
            "unnamed".into()
        } else {
            cfg.name.clone()
        },
        cfg.arch.name(),
        cfg.n_layer,
        cfg.d_model,
        cfg.vocab,
        llm.memory().weights as f64 / 1e6,
        made,
        t1.elapsed().as_secs_f64()
    );
    let mut rng = SeedRng::new(3);
    let prompt: Vec<u32> = (0..a.prompt).map(|_| rng.below(cfg.vocab) as u32).collect();
    // Decoding as `run --temperature 0` does it (the next token picked on the device where it can be),
    // `n` passes after the prompt.
    let decode_guarded = |llm: &mut Llm, guard: Option<&mut DriftGuard>| -> Result<usize> {
        let mut greedy =
            tinygpt_models::sampler::Sampler::new(tinygpt_models::sampler::SamplerConfig {
                temperature: 0.0,
                ..Default::default()
            });
        let g = pollster::block_on(tinygpt_models::llm::generate_guarded(
            be,
            llm,
            &mut greedy,
            a.n + 1,
            |_| false,
            async |_| -> Result<bool> { Ok(true) },
            guard,
            |e| eprintln!("[ops] drift guard tripped at position {}", e.position),
        ))?;
        Ok(g.passes)
    };
    let decode = |llm: &mut Llm| decode_guarded(llm, None);
    // Warm-up: every pipeline built once.
    llm.feed(be, &prompt)?;
    decode(&mut llm)?;
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    let mut per_token = None;
    for _ in 0..a.reps.max(1) {
        llm.reset();
        let t = Instant::now();
        llm.feed(be, &prompt)?;
        be.sync()?;
        pp.push(a.prompt as f64 / t.elapsed().as_secs_f64());
        let c0 = be.as_gpu().map(|g| g.counters());
        let t = Instant::now();
        let passes = decode(&mut llm)?;
        tg.push(passes as f64 / t.elapsed().as_secs_f64());
        if let (Some(g), Some(c0)) = (be.as_gpu(), c0) {
            let c = g.counters();
            let per = |x: u64, y: u64| (x - y) as f64 / passes.max(1) as f64;
            per_token = Some((
                per(c.dispatches, c0.dispatches),
                per(c.submits, c0.submits),
                per(c.readbacks, c0.readbacks),
            ));
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "prompt {} tokens: {:.0} tok/s · decode {} tokens: {:.1} tok/s (median of {}) · {}",
        a.prompt,
        median(&mut pp),
        a.n,
        median(&mut tg),
        a.reps.max(1),
        pills(llm.paths())
    );
    if let Some((d, s, r)) = per_token {
        println!("per decoded token: {d:.1} dispatches, {s:.2} submits, {r:.2} readbacks");
    }
    // The same decode watched by the drift guard (as `run` and `chat` decode on fast paths).
    if be.as_gpu().is_some() && !llm.paths().is_empty() && drift_check > 0 {
        let mut guard = DriftGuard::new(
            GgufFile::from_bytes(file.bytes().to_vec())?,
            llm.context(),
            drift_check,
            gate.shadow_threads(),
            true,
        );
        let mut guarded = Vec::new();
        // The first run makes the guard's f32 shadow on the CPU (once per run of `run` or `chat`).
        for rep in 0..=a.reps.max(1) {
            llm.reset();
            llm.feed(be, &prompt)?;
            be.sync()?;
            let t = Instant::now();
            let passes = decode_guarded(&mut llm, Some(&mut guard))?;
            if rep > 0 {
                guarded.push(passes as f64 / t.elapsed().as_secs_f64());
            }
        }
        let s = guard.stats();
        let (plain, with) = (median(&mut tg), median(&mut guarded));
        println!(
            "decode with the drift guard every {drift_check}: {with:.1} tok/s ({:+.1}% against {plain:.1}) · {} checks, {} same top-1, worst KL {:.2e} ({:.2e} of its bound) · a check: {:.2} ms reading cache rows, {:.1} ms of shadow step",
            100.0 * (with / plain - 1.0),
            s.checks,
            s.same_top1,
            s.worst_kl,
            s.worst_ratio,
            1e3 * s.read_secs / s.checks.max(1) as f64,
            1e3 * s.shadow_secs / s.checks.max(1) as f64
        );
    }
    if par > 1 {
        batched_decode(be, &mut llm, &prompt, a.n, a.reps, a.profile)?;
    }
    if let (true, Some(g)) = (a.profile, be.as_gpu()) {
        llm.reset();
        g.start_profiling()?;
        llm.feed(be, &prompt)?;
        print_profile(&g.profile()?, "prompt pass", 1);
        g.start_profiling()?;
        let passes = decode(&mut llm)?;
        print_profile(&g.profile()?, "decoded token", passes);
    }
    Ok(())
}

/// `par` sequences (the model's `sequences`) each fed `prompt`, then `n` decode passes of one token for
/// every sequence, the greedy picks read back after each pass: aggregate decoded tokens per second,
/// median of `reps`.
fn batched_decode(
    be: &Backend,
    llm: &mut tinygpt_models::llm::Llm,
    prompt: &[u32],
    n: usize,
    reps: usize,
    profile: bool,
) -> Result<()> {
    use tinygpt_models::llm::Feed;
    let par = llm.parallel();
    let mut seqs = (0..par)
        .map(|_| llm.new_sequence())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut rates = Vec::new();
    // Greedy ids of every row at every step of the last repetition, and of the first sequence alone.
    let mut rows_ids: Vec<Vec<u32>> = Vec::new();
    for rep in 0..=reps.max(1) + 1 {
        // The last round decodes the first sequence alone, for the comparison.
        let alone = rep == reps.max(1) + 1;
        let take = if alone { 1 } else { par };
        for s in seqs.iter_mut().take(take) {
            s.reset();
            llm.feed_sequence(be, s, prompt)?;
        }
        // Every sequence starts from the same token; the passes then feed the device's picks.
        let mut refs: Vec<&mut tinygpt_models::llm::Sequence> =
            seqs.iter_mut().take(take).collect();
        llm.decode_step(be, &mut refs, Feed::Ids(&vec![1; take]))?;
        be.sync()?;
        let t = Instant::now();
        let mut ids = Vec::new();
        for _ in 1..n {
            llm.pick_greedy(be)?;
            llm.decode_step(be, &mut refs, Feed::Picked)?;
            let p = llm.read_picks(be)?;
            ids.push(pollster::block_on(llm.finish_picks(be, p))?);
        }
        if alone {
            // Only the first row of each step is this sequence's (the ids of a pass).
            let mine: Vec<u32> = ids.iter().map(|r| r[0]).collect();
            let same = rows_ids.iter().all(|r| *r == mine);
            println!(
                "batched rows equal to the sequence decoded alone: {}",
                if same { "yes, every row" } else { "NO" }
            );
            if !same {
                anyhow::bail!(
                    "a row of the batched decode differs from the same sequence decoded alone"
                );
            }
            break;
        }
        rows_ids = (0..par)
            .map(|r| ids.iter().map(|step| step[r]).collect())
            .collect();
        // The first repetition warms up (pipelines for every row count).
        if rep > 0 {
            rates.push((par * (n - 1)) as f64 / t.elapsed().as_secs_f64());
        }
    }
    rates.sort_by(f64::total_cmp);
    println!(
        "batched decode, {par} sequences x {} tokens: {:.0} tok/s aggregate (median of {})",
        n - 1,
        rates[rates.len() / 2],
        rates.len()
    );
    if let (true, Some(g)) = (profile, be.as_gpu()) {
        // The comparison round above left one sequence's picks: start every sequence again.
        for s in seqs.iter_mut() {
            s.reset();
            llm.feed_sequence(be, s, prompt)?;
        }
        let mut refs: Vec<&mut tinygpt_models::llm::Sequence> = seqs.iter_mut().collect();
        llm.decode_step(be, &mut refs, Feed::Ids(&vec![1; par]))?;
        be.sync()?;
        g.start_profiling()?;
        for _ in 0..8 {
            llm.pick_greedy(be)?;
            llm.decode_step(be, &mut refs, Feed::Picked)?;
        }
        print_profile(&g.profile()?, &format!("batched pass of {par}"), 8);
    }
    Ok(())
}

/// Each kernel's device time per unit of work (`per` units), the costliest first.
fn print_profile(times: &[tinygpt_kernels::gpu::KernelTime], unit: &str, per: usize) {
    let per = per.max(1) as f64;
    let total: f64 = times.iter().map(|t| t.micros).sum();
    println!(
        "device time per {unit}: {:.1} µs in {:.1} dispatches (each timed alone: the sum of kernel times)",
        total / per,
        times.iter().map(|t| t.dispatches as f64).sum::<f64>() / per
    );
    for t in times {
        println!(
            "  {:>9.1} µs {:>5.1}% {:>7.1}x  {}",
            t.micros / per,
            100.0 * t.micros / total.max(1e-9),
            t.dispatches as f64 / per,
            t.kernel
        );
    }
}
