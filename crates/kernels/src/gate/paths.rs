//! The registry of fast paths: each row is the five things a path is — detection, kernels (in the op
//! folder its `evaluate` calls), gate, activation flag and pill. Adding a path is adding a row here and
//! its kernel + evaluate function in its op folder.

use super::{CaseOutput, GateCase, PathId};
use crate::backend::{Backend, TMut, Tensor};
use crate::error::{Error, Result};
use crate::gpu::GpuBackend;

/// One fast path.
pub struct PathDef {
    pub id: PathId,
    /// Name in log lines ("f16-storage").
    pub name: &'static str,
    /// Capability pill ("+f16 storage").
    pub pill: &'static str,
    /// Said when the path turns on ("f16 path active").
    pub active_text: &'static str,
    /// Bump when the path's kernels change: cached verdicts of older versions are not trusted.
    pub kernel_version: u32,
    /// Paths that must be active first.
    pub requires: &'static [PathId],
    /// Ok when the adapter has what the path needs; Err says what is missing.
    pub detect: fn(&GpuBackend) -> std::result::Result<(), String>,
    /// Runs the path's kernel and its canonical f32 twin at one shape.
    pub evaluate: fn(&Backend, &GateCase, u64) -> Result<CaseOutput>,
}

fn has(g: &GpuBackend, f: wgpu::Features, name: &str) -> std::result::Result<(), String> {
    if g.has_feature(f) {
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
        // pack2x16float / unpack2x16float are core WGSL: every adapter can store f16 in u32 words.
        detect: |_| Ok(()),
        evaluate: |be, c, s| crate::ops::matmul_f16::gate_evaluate(be, c, s, false),
    },
    PathDef {
        id: PathId::ShaderF16,
        name: "shader-f16",
        pill: "+shader-f16",
        active_text: "shader-f16 path active",
        kernel_version: 1,
        requires: &[PathId::F16Storage],
        detect: |g| has(g, wgpu::Features::SHADER_F16, "SHADER_F16"),
        evaluate: |be, c, s| crate::ops::matmul_f16::gate_evaluate(be, c, s, true),
    },
    PathDef {
        id: PathId::Subgroups,
        name: "subgroups",
        pill: "+subgroups",
        active_text: "subgroup path active",
        kernel_version: 1,
        requires: &[],
        detect: |g| {
            has(g, wgpu::Features::SUBGROUP, "SUBGROUP")?;
            // The decode kernel's reduction assumes a subgroup never spans two of its 32-lane slices.
            let max = g.info().subgroup_max_size;
            if max == 0 || max > 32 || 32 % max != 0 {
                return Err(format!(
                    "subgroups of up to {max} lanes (the kernels need at most 32)"
                ));
            }
            Ok(())
        },
        evaluate: crate::ops::matmul::gate_evaluate_subgroups,
    },
    PathDef {
        id: PathId::CoopMatrix,
        name: "coop-matrix",
        pill: "+coop-matrix",
        active_text: "cooperative-matrix path active",
        kernel_version: 1,
        requires: &[PathId::F16Storage],
        detect: |g| {
            has(
                g,
                wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
                "EXPERIMENTAL_COOPERATIVE_MATRIX",
            )?;
            has(g, wgpu::Features::SHADER_F16, "SHADER_F16")?;
            if !g
                .info()
                .cooperative_matrix
                .iter()
                .any(|s| s.starts_with("16x16x16 F16->F32"))
            {
                return Err("no 16x16x16 f16 -> f32 cooperative-matrix shape".into());
            }
            Ok(())
        },
        evaluate: crate::ops::matmul_coop::gate_evaluate,
    },
    PathDef {
        id: PathId::QuantMatmul,
        name: "q8-matmul",
        pill: "+q8 matmul",
        active_text: "quantized matmul active",
        kernel_version: 1,
        requires: &[],
        detect: |_| Ok(()),
        evaluate: crate::ops::quant_matmul::gate_evaluate,
    },
];

/// The registry row of `id`.
pub fn def(id: PathId) -> &'static PathDef {
    REGISTRY
        .iter()
        .find(|d| d.id == id)
        .expect("every PathId has a registry row")
}

/// Value the guard region after a gated output is filled with (and must still hold afterwards).
pub const GUARD: f32 = 1234.5;

/// The gate's inputs for one shape: x [m, k] and W [n, k], uniform in [-0.2, 0.2] from `seed`.
pub fn inputs(c: &GateCase, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = crate::testing::SeedRng::new(seed ^ ((c.m * 31 + c.n * 17 + c.k) as u64));
    (rng.vec(c.m * c.k, -0.2, 0.2), rng.vec(c.n * c.k, -0.2, 0.2))
}

/// The canonical f32 result x · Wᵀ (the CPU twin).
#[cfg(not(target_arch = "wasm32"))]
pub fn reference(c: &GateCase, x: &[f32], w: &[f32]) -> Vec<f32> {
    let cpu = crate::testing::cpu_backend();
    let (tx, tw) = (
        cpu.from_f32(x, 1).expect("cpu"),
        cpu.from_f32(w, 1).expect("cpu"),
    );
    let mut ty = cpu.zeros(c.m * c.n, 1).expect("cpu");
    crate::ops::matmul::matmul(
        &cpu,
        (&tx).into(),
        (&tw).into(),
        (&mut ty).into(),
        &crate::ops::matmul::Gemm::nt(c.m, c.n, c.k),
    )
    .expect("cpu matmul of matching shapes");
    cpu.to_vec(&ty).expect("cpu")
}

/// An output of m·n elements poisoned with NaN, followed by a guard region.
pub fn guarded_output(be: &Backend, c: &GateCase) -> Result<Tensor> {
    let mut v = vec![f32::NAN; c.m * c.n];
    v.extend(std::iter::repeat_n(GUARD, c.n + 64));
    be.from_f32(&v, 1)
}

/// Reads a guarded output back: (the m·n results, whether the guard is intact).
#[cfg(not(target_arch = "wasm32"))]
pub fn read_guarded(be: &Backend, t: &Tensor, c: &GateCase) -> Result<(Vec<f32>, bool)> {
    be.sync()?;
    let mut v = be.to_vec(t)?;
    let guard = v.split_off(c.m * c.n);
    Ok((v, guard.iter().all(|&g| g == GUARD)))
}

/// The harness every x · Wᵀ fast path's gate shares: seeded inputs, W uploaded as f32 or packed f16
/// pairs, a poisoned output with a guard region behind it, `kernel(gpu, x, w, out)` (offsets 0), and the
/// canonical f32 result.
#[cfg(not(target_arch = "wasm32"))]
pub fn evaluate_nt(
    be: &Backend,
    c: &GateCase,
    seed: u64,
    f16_weights: bool,
    kernel: impl FnOnce(
        &GpuBackend,
        &crate::gpu::GpuTensor,
        &crate::gpu::GpuTensor,
        &crate::gpu::GpuTensor,
    ) -> Result<()>,
) -> Result<CaseOutput> {
    use crate::ops::matmul_f16::{pack_f16, packed_len};
    let g = gpu_of(be)?;
    let (x, w) = inputs(c, seed);
    let tx = be.from_f32(&x, 1)?;
    let mut tw = be.from_f32(&w, 1)?;
    if f16_weights {
        let mut packed = be.zeros_typed(packed_len(w.len()), 1, crate::DType::U32)?;
        pack_f16(be, (&tw).into(), (&mut packed).into(), w.len())?;
        tw = packed;
    }
    let out = guarded_output(be, c)?;
    fn gpu(t: &Tensor) -> Result<&crate::gpu::GpuTensor> {
        t.gpu()
            .ok_or_else(|| Error::Gpu("gate tensors live on the GPU".into()))
    }
    kernel(g, gpu(&tx)?, gpu(&tw)?, gpu(&out)?)?;
    let (fast, guard_intact) = read_guarded(be, &out, c)?;
    Ok(CaseOutput {
        reference: reference(c, &x, &w),
        fast,
        guard_intact,
    })
}

/// Gates only make sense on a GPU.
pub fn gpu_of(be: &Backend) -> Result<&GpuBackend> {
    be.as_gpu().ok_or_else(|| Error::Shape {
        op: "gate",
        msg: "fast paths are gated on a GPU backend".into(),
    })
}

/// A writable view of a whole tensor (helper for the evaluate functions).
pub fn whole(t: &mut Tensor) -> TMut<'_> {
    t.at_mut(0)
}
