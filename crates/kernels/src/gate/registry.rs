//! The registry of fast paths: each row is what a path is — its id, name and pill, how it is detected,
//! its kernel version, what it needs first, and how one shape of its gate is evaluated (its kernels live
//! in their op folder; the evaluation here calls them). Adding a path is one [`PathId`], one row here and
//! its kernel; every list of names the CLI prints comes from this table.

use super::{GateCase, Pending, guarded_output};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::gpu::GpuBackend;
use crate::ops::matmul::quant::cpu_int::int_dot_available;
use crate::ops::matmul::{
    self, Choice, Gemm, Kernel, QMatrix, QuantSource, Weights, mixed_tiles, pack_f16, packed_len,
};
use crate::path::{PathId, PathSet};
use crate::rng::SeedRng;

/// One fast path.
pub struct PathDef {
    pub id: PathId,
    /// Name in log lines, flags and the cache ("f16-storage").
    pub name: &'static str,
    /// Capability pill ("+f16 storage").
    pub pill: &'static str,
    /// Said when the path turns on ("f16 path active").
    pub active_text: &'static str,
    /// Bump when the path's kernels change: stored verdicts of older versions are not trusted.
    pub kernel_version: u32,
    /// Paths that must pass first (and are evaluated together with this one).
    pub requires: &'static [PathId],
    /// The backend whose kernels the path replaces: the CPU backend's paths are gated (and shown) on
    /// the CPU backend, the others on a GPU.
    pub on_cpu: bool,
    /// Ok when the device has what the path needs; Err says what is missing. Only called on the
    /// path's own kind of backend ([`PathDef::on_cpu`]).
    pub detect: fn(&Backend) -> std::result::Result<(), String>,
    /// Records the path's kernel(s) at one shape with the kernels of the given set (the path, what it
    /// requires, and in tests a planted fault), each beside its canonical f32 result.
    pub evaluate: fn(&Backend, &GateCase, u64, PathSet) -> Result<Vec<Pending>>,
}

fn has(be: &Backend, f: wgpu::Features, name: &str) -> std::result::Result<(), String> {
    if gpu(be)?.has_feature(f) {
        Ok(())
    } else {
        Err(format!("the adapter lacks {name}"))
    }
}

pub static REGISTRY: &[PathDef] = &[
    PathDef {
        id: PathId::F16Storage,
        name: "f16-storage",
        pill: "+f16 storage",
        active_text: "f16 path active",
        kernel_version: 1,
        requires: &[],
        on_cpu: false,
        // pack2x16float / unpack2x16float are core WGSL: every adapter can store f16 in u32 words.
        detect: |be| gpu(be).map(|_| ()),
        evaluate: |be, c, seed, paths| evaluate_nt(be, c, seed, true, |_| None, paths),
    },
    PathDef {
        id: PathId::ShaderF16,
        name: "shader-f16",
        pill: "+shader-f16",
        active_text: "shader-f16 path active",
        kernel_version: 1,
        requires: &[PathId::F16Storage],
        on_cpu: false,
        detect: |g| has(g, wgpu::Features::SHADER_F16, "SHADER_F16"),
        evaluate: |be, c, seed, paths| evaluate_nt(be, c, seed, true, |_| None, paths),
    },
    PathDef {
        id: PathId::Subgroups,
        name: "subgroups",
        pill: "+subgroups",
        active_text: "subgroup path active",
        kernel_version: 1,
        requires: &[],
        on_cpu: false,
        detect: |be| {
            has(be, wgpu::Features::SUBGROUP, "SUBGROUP")?;
            // The decode kernel's reduction assumes a subgroup never spans two of its 32-lane slices.
            let max = gpu(be)?.info().subgroup_max_size;
            if max == 0 || max > 32 || 32 % max != 0 {
                return Err(format!(
                    "subgroups of up to {max} lanes (the kernels need at most 32)"
                ));
            }
            Ok(())
        },
        // The decode kernel (m <= 8) reduces with `subgroupAdd`; the tiled kernel, which the path leaves
        // unchanged, takes the larger shapes.
        evaluate: |be, c, seed, paths| evaluate_nt(be, c, seed, false, |_| None, paths),
    },
    PathDef {
        id: PathId::CoopMatrix,
        name: "coop-matrix",
        pill: "+coop-matrix",
        active_text: "cooperative-matrix path active",
        kernel_version: 1,
        requires: &[PathId::F16Storage],
        on_cpu: false,
        detect: |be| {
            has(
                be,
                wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
                "EXPERIMENTAL_COOPERATIVE_MATRIX",
            )?;
            has(be, wgpu::Features::SHADER_F16, "SHADER_F16")?;
            if !gpu(be)?
                .info()
                .cooperative_matrix
                .iter()
                .any(|s| s.starts_with("16x16x16 F16->F32"))
            {
                return Err("no 16x16x16 f16 -> f32 cooperative-matrix shape".into());
            }
            Ok(())
        },
        // The tensor-core kernel at every shape, even those it would not be chosen for: small shapes use
        // mostly-empty tiles, which exercises its edge handling.
        evaluate: |be, c, seed, paths| {
            evaluate_nt(
                be,
                c,
                seed,
                true,
                |p| Some(Choice::forced(Kernel::Coop, p)),
                paths,
            )
        },
    },
    PathDef {
        id: PathId::QuantMatmul,
        name: "q8-matmul",
        pill: "+q8 matmul",
        active_text: "quantized matmul active",
        kernel_version: 5,
        requires: &[],
        on_cpu: false,
        detect: |be| gpu(be).map(|_| ()),
        evaluate: evaluate_quant,
    },
    PathDef {
        id: PathId::CoopQuant,
        name: "tc-prompt",
        pill: "+tensor-core prompts",
        active_text: "tensor-core prompt products active",
        kernel_version: 2,
        requires: &[PathId::QuantMatmul, PathId::CoopMatrix],
        on_cpu: false,
        detect: |g| (def(PathId::CoopMatrix).detect)(g),
        // The tensor-core GEMM at every shape, decode rows included (mostly-empty tiles exercise its
        // edges), on both weight layouts.
        evaluate: |be, c, seed, paths| {
            evaluate_quant_on(be, c, seed, paths, Some(Kernel::QuantCoop))
        },
    },
    PathDef {
        id: PathId::MixedTraining,
        name: "tc-training",
        pill: "+tensor-core training",
        active_text: "tensor-core training active",
        kernel_version: 9,
        requires: &[PathId::CoopMatrix],
        on_cpu: false,
        detect: |g| (def(PathId::CoopMatrix).detect)(g),
        // The op gate checks the mixed-precision kernel (f32 operands rounded to f16, and f16 weights
        // as the trainer reads its block matrices) at every shape, on every tile shape the adapter's
        // products can choose; a trainer then runs the training gate (the first steps' losses against
        // the f32 path) before it trains on it.
        evaluate: |be, c, seed, paths| {
            let mut all = Vec::new();
            let pairs = c.n % 2 == 0 && c.k % 2 == 0;
            for tile in mixed_tiles(gpu_of(be)?) {
                for f16_weights in [false, true] {
                    if f16_weights && !pairs {
                        continue;
                    }
                    let force = |p| Some(Choice::forced(Kernel::CoopMixed(tile), p));
                    all.extend(evaluate_nt(be, c, seed, f16_weights, force, paths)?);
                }
            }
            Ok(all)
        },
    },
    PathDef {
        id: PathId::IntDot,
        name: "int-dot",
        pill: "+int dot",
        active_text: "integer dot products active",
        kernel_version: 1,
        requires: &[],
        on_cpu: true,
        detect: |be| {
            if be.as_gpu().is_some() {
                return Err("a CPU backend path".into());
            }
            if int_dot_available() {
                Ok(())
            } else {
                Err("the CPU lacks AVX-512 VNNI".into())
            }
        },
        evaluate: evaluate_quant,
    },
];

/// The registry row of `id`.
pub fn def(id: PathId) -> &'static PathDef {
    REGISTRY
        .iter()
        .find(|d| d.id == id)
        .expect("every PathId has a registry row")
}

impl PathId {
    /// The name used in log lines, flags and the cache ("f16-storage").
    pub fn name(self) -> &'static str {
        def(self).name
    }

    /// The capability pill ("+f16 storage").
    pub fn pill(self) -> &'static str {
        def(self).pill
    }

    /// What the log line says when the path turns on.
    pub fn active_text(self) -> &'static str {
        def(self).active_text
    }

    /// The version of the path's kernels (part of every cache key).
    pub fn kernel_version(self) -> u32 {
        def(self).kernel_version
    }

    /// The path called `name`, if there is one.
    pub fn from_name(name: &str) -> Option<PathId> {
        REGISTRY.iter().find(|d| d.name == name).map(|d| d.id)
    }

    /// The path with every path it requires, and theirs: the smallest set in which it runs (a path
    /// held without its prerequisites never reaches its kernels).
    pub fn with_prerequisites(self) -> PathSet {
        def(self)
            .requires
            .iter()
            .flat_map(|r| r.with_prerequisites().iter())
            .fold(PathSet::F32.with(self), PathSet::with)
    }
}

/// Every path's name, comma-separated (for messages listing what exists).
pub fn names() -> String {
    REGISTRY
        .iter()
        .map(|d| d.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The gate's inputs for one shape: x [m, k] and W [n, k], uniform in [-0.2, 0.2] from `seed`.
pub fn inputs(c: &GateCase, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SeedRng::new(seed ^ ((c.m * 31 + c.n * 17 + c.k) as u64));
    (rng.vec(c.m * c.k, -0.2, 0.2), rng.vec(c.n * c.k, -0.2, 0.2))
}

/// The canonical f32 result x · Wᵀ: the CPU twin, run on the host whatever backend is being gated.
pub fn reference(c: &GateCase, x: &[f32], w: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; c.m * c.n];
    matmul::cpu_gemm(x, w, &mut y, &Gemm::nt(c.m, c.n, c.k));
    y
}

/// The harness every x · Wᵀ fast path's gate shares: seeded inputs, W uploaded as f32 or packed f16
/// pairs, a poisoned output with a guard region behind it, the product on the kernel `force` names (or
/// the one the path set chooses), and the canonical f32 result.
fn evaluate_nt(
    be: &Backend,
    c: &GateCase,
    seed: u64,
    f16_weights: bool,
    force: impl FnOnce(PathSet) -> Option<Choice>,
    paths: PathSet,
) -> Result<Vec<Pending>> {
    gpu_of(be)?;
    let (x, w) = inputs(c, seed);
    let tx = be.from_f32(&x, 1)?;
    let tw = be.from_f32(&w, 1)?;
    let packed = if f16_weights {
        let mut p = be.zeros_typed(packed_len(w.len()), 1, crate::DType::U32)?;
        pack_f16(be, (&tw).into(), (&mut p).into(), w.len())?;
        Some(p)
    } else {
        None
    };
    let wv: Weights<'_> = match &packed {
        Some(p) => Weights::F16(p.into()),
        None => (&tw).into(),
    };
    let mut out = guarded_output(be, c)?;
    let g = Gemm::nt(c.m, c.n, c.k);
    match force(paths) {
        Some(choice) => matmul::run(be, choice, (&tx).into(), wv, (&mut out).into(), &g)?,
        None => matmul::matmul(be, paths, (&tx).into(), wv, (&mut out).into(), &g)?,
    }
    Ok(vec![Pending {
        reference: reference(c, &x, &w),
        output: out,
    }])
}

/// The quantized-matmul gate at one shape (the GPU's `q8-matmul` and the CPU's `int-dot`): the Q8
/// (blocks of 32, and of 16 on the CPU) and Q4 kernels, each against the f32 product with its own
/// dequantized weights (the twin); the worst is what the gate sees.
fn evaluate_quant(be: &Backend, c: &GateCase, seed: u64, paths: PathSet) -> Result<Vec<Pending>> {
    evaluate_quant_on(be, c, seed, paths, None)
}

/// [`evaluate_quant`] on the kernel `force` names (None: the one the path set chooses).
fn evaluate_quant_on(
    be: &Backend,
    c: &GateCase,
    seed: u64,
    paths: PathSet,
    force: Option<Kernel>,
) -> Result<Vec<Pending>> {
    use crate::ops::matmul::quant::{quantize_q4, quantize_q8};
    let (x, w) = inputs(c, seed);
    let tx = be.from_f32(&x, 1)?;
    let mut sources = vec![
        QuantSource::Q8(quantize_q8(&w, c.n, c.k, 32)),
        QuantSource::Q4(quantize_q4(&w, c.n, c.k)),
    ];
    if be.as_gpu().is_none() {
        sources.push(QuantSource::Q8(quantize_q8(&w, c.n, c.k, 16)));
    }
    sources
        .into_iter()
        .map(|src| {
            let dense = src.dequantize();
            let wm = QMatrix::upload(be, src, paths)?;
            let mut out = guarded_output(be, c)?;
            let g = Gemm::nt(c.m, c.n, c.k);
            match force {
                Some(k) => {
                    let choice = Choice::forced(k, paths);
                    matmul::run(
                        be,
                        choice,
                        (&tx).into(),
                        (&wm).into(),
                        (&mut out).into(),
                        &g,
                    )?
                }
                None => matmul::matmul(be, paths, (&tx).into(), &wm, (&mut out).into(), &g)?,
            }
            Ok(Pending {
                reference: reference(c, &x, &dense),
                output: out,
            })
        })
        .collect()
}

/// [`gpu_of`] for a path's `detect`: the reason as text.
fn gpu(be: &Backend) -> std::result::Result<&GpuBackend, String> {
    gpu_of(be).map_err(|e| e.to_string())
}

/// The GPU a GPU path's evaluation runs on.
fn gpu_of(be: &Backend) -> Result<&GpuBackend> {
    be.as_gpu().ok_or_else(|| Error::Shape {
        op: "gate",
        msg: "this fast path's kernels run on a GPU backend".into(),
    })
}
