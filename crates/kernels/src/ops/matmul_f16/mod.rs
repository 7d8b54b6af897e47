//! The f16-storage fast path: weights stored as f16 pairs in u32 words (`pack2x16float`) and read by
//! variants of the GEMM and GEMV kernels that unpack them and accumulate in f32 — half the weight bytes
//! for forward products whose weight is only read. With the shader-f16 path also active, the same
//! kernels stage tiles as f16 and multiply f16 operands (`enable f16`), still accumulating in f32.
//!
//! Backward products and the optimizer stay f32; a trainer re-packs its weights at the top of every
//! step, so the packed copy never goes stale.

use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gate::{CaseOutput, GateCase, PathId};
use crate::gpu::{Access, Operand};
use crate::ops::common::{Grid, kernel, run};
use crate::ops::matmul::{Gemm, KernelChoice, gpu_matmul};

/// Words needed to pack `n` f32 values.
pub fn packed_len(n: usize) -> usize {
    n.div_ceil(2)
}

/// dst (u32 words) ← `n` values of src as f16 pairs, round to nearest even (as `pack2x16float` does on
/// every adapter we have seen; the gate checks the result either way).
pub fn pack_f16(be: &Backend, src: TRef<'_>, mut dst: TMut<'_>, n: usize) -> Result<()> {
    let words = packed_len(n);
    match be {
        Backend::Cpu(_) => {
            let s = src.cpu("pack_f16", "src", n)?;
            let d = dst.cpu_u32("pack_f16", "dst", words)?;
            for (i, w) in d.iter_mut().enumerate() {
                let lo = half::f16::from_f32(s[2 * i]).to_bits() as u32;
                let hi = s
                    .get(2 * i + 1)
                    .map_or(0, |&v| half::f16::from_f32(v).to_bits() as u32);
                *w = lo | (hi << 16);
            }
            Ok(())
        }
        Backend::Gpu(g) => {
            let ts = src.gpu("pack_f16", "src", n)?;
            let td = dst.gpu("pack_f16", "dst", words)?;
            if ts.num_chunks() != 1 || td.num_chunks() != 1 {
                return Err(Error::Shape {
                    op: "pack_f16",
                    msg: "packing works on tensors in one buffer".into(),
                });
            }
            let pipe = kernel(
                g,
                "pack_f16",
                include_str!("pack.wgsl"),
                &[Access::Read, Access::ReadWrite],
            )?;
            let ops = [
                Operand::whole(ts, src.offset(), n),
                Operand::whole(td, dst.offset(), words),
            ];
            run(
                g,
                "pack_f16",
                &pipe,
                words,
                &ops,
                &[n as u32],
                Grid::Threads(256),
            )
        }
    }
}

/// Unpacks f16 pairs (the CPU twin's view of a packed weight).
pub fn unpack_f16(words: &[u32], n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| half::f16::from_bits((words[i / 2] >> (16 * (i % 2))) as u16).to_f32())
        .collect()
}

/// C = alpha · A · Bᵀ (+ beta · C) with B packed f16: `g` must be an A·Bᵀ product (`Gemm::nt`), `b`
/// views the packed words and `g.ldb` counts f16 elements (even, as is the view's start in elements).
/// Large products go to the tensor cores when the cooperative-matrix path passed its gate.
pub fn matmul_f16w(be: &Backend, a: TRef<'_>, b: TRef<'_>, c: TMut<'_>, g: &Gemm) -> Result<()> {
    matmul_f16w_with(be, a, b, c, g, true)
}

/// [`matmul_f16w`], choosing whether the cooperative-matrix kernel may take large products (training
/// keeps it off: on an H200 it measured slower than the f32 kernels for that model, docs/perf.md).
pub fn matmul_f16w_with(
    be: &Backend,
    a: TRef<'_>,
    b: TRef<'_>,
    mut c: TMut<'_>,
    g: &Gemm,
    allow_coop: bool,
) -> Result<()> {
    if g.trans_a || !g.trans_b || g.batches() != 1 || !g.ldb.is_multiple_of(2) {
        return Err(Error::Shape {
            op: "matmul_f16w",
            msg: "f16 weights serve x·Wᵀ products (Gemm::nt) with an even row length, unbatched"
                .into(),
        });
    }
    let [ea, eb, ec] = g.extents();
    let words = packed_len(eb);
    match be {
        Backend::Cpu(_) => {
            let w = unpack_f16(b.cpu_u32("matmul_f16w", "B", words)?, eb);
            let cpu = crate::testing::cpu_backend();
            let (ta, tb) = (
                cpu.from_f32(a.cpu("matmul_f16w", "A", ea)?, 1)?,
                cpu.from_f32(&w, 1)?,
            );
            let mut tc = cpu.from_f32(c.cpu("matmul_f16w", "C", ec)?, 1)?;
            crate::ops::matmul::matmul(&cpu, (&ta).into(), (&tb).into(), (&mut tc).into(), g)?;
            c.cpu("matmul_f16w", "C", ec)?
                .copy_from_slice(tc.cpu().expect("cpu"));
            Ok(())
        }
        Backend::Gpu(gb) => {
            let ta = a.gpu("matmul_f16w", "A", ea)?;
            let tb = b.gpu("matmul_f16w", "B", words)?;
            let tc = c.gpu("matmul_f16w", "C", ec)?;
            let choice = KernelChoice {
                b_f16: true,
                shader_f16: gb.path_active(PathId::ShaderF16),
                subgroups: gb.path_active(PathId::Subgroups),
            };
            if allow_coop && gb.path_active(PathId::CoopMatrix) && crate::ops::matmul_coop::suits(g)
            {
                return crate::ops::matmul_coop::matmul_coop(
                    gb,
                    (ta, a.offset()),
                    (tb, 2 * b.offset()),
                    (tc, c.offset()),
                    g,
                );
            }
            gpu_matmul(
                gb,
                (ta, a.offset()),
                (tb, 2 * b.offset()),
                (tc, c.offset()),
                g,
                None,
                choice,
            )
        }
    }
}

/// The f16-storage (or, with `shader_f16`, the shader-f16) gate at one shape.
#[cfg(not(target_arch = "wasm32"))]
pub fn gate_evaluate(
    be: &Backend,
    c: &GateCase,
    seed: u64,
    shader_f16: bool,
) -> Result<CaseOutput> {
    let choice = KernelChoice {
        b_f16: true,
        shader_f16,
        subgroups: false,
    };
    crate::gate::paths::evaluate_nt(be, c, seed, true, |g, x, w, out| {
        gpu_matmul(
            g,
            (x, 0),
            (w, 0),
            (out, 0),
            &Gemm::nt(c.m, c.n, c.k),
            None,
            choice,
        )
    })
}

#[cfg(target_arch = "wasm32")]
pub fn gate_evaluate(_: &Backend, _: &GateCase, _: u64, _: bool) -> Result<CaseOutput> {
    Err(Error::Shape {
        op: "gate",
        msg: "gates run asynchronously on the web".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin};

    #[test]
    fn f16_weight_products_match_their_twin() {
        let mut rng = SeedRng::new(120);
        for (m, n, k) in [(1, 33, 64), (3, 7, 130), (70, 41, 96)] {
            let x = rng.vec(m * k, -1.0, 1.0);
            let w = rng.vec(n * k, -1.0, 1.0);
            let args = [
                Arg::data(x, 1),
                Arg::data(w, 1),
                Arg::out(packed_len(n * k), 1),
                Arg::out(m * n, 1),
            ];
            let out = check_twin("matmul_f16w", 1e-10, &args, None, |be, t| {
                let [tx, tw, tp, ty] = t else { unreachable!() };
                pack_f16(be, (&*tw).into(), (&mut *tp).into(), n * k)?;
                matmul_f16w(
                    be,
                    (&*tx).into(),
                    (&*tp).into(),
                    ty.into(),
                    &Gemm::nt(m, n, k),
                )
            });
            // f16 storage changes the weights by at most half an f16 ulp.
            let unpacked = unpack_f16(bytemuck::cast_slice(&out[2]), n * k);
            for (u, &orig) in unpacked.iter().zip(&out[1]) {
                assert!((u - orig).abs() <= orig.abs() * 4.9e-4 + 1e-7);
            }
        }
    }
}
