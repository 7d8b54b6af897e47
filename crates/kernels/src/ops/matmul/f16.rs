//! The f16-storage format: weights stored as f16 pairs in u32 words (`pack2x16float`), read by variants
//! of the GEMM and GEMV kernels that unpack them and accumulate in f32 — half the weight bytes for
//! forward products whose weight is only read ([`super::Weights::F16`]). With the shader-f16 path, the
//! same kernels stage tiles as f16 and multiply f16 operands (`enable f16`), still accumulating in f32.
//!
//! A trainer re-packs its weights at the top of every step, so the packed copy never goes stale; the
//! optimizer stays f32. On the tensor-core training path the backward products read the packed
//! weights too, and the activations and gradients only that path's products read are written as f16
//! pairs by their producers ([`pack_f16_of`] where a producer has no pairs kernel of its own).

use crate::backend::{Backend, TMut, TRef};
use crate::error::{Error, Result};
use crate::gpu::{Access, GpuBackend, GpuTensor, Operand};
use crate::ops::common::{Grid, kernel, run};

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
            let source = include_str!("pack_f16.wgsl");
            let (from, to) = ((src, n), (dst, words));
            gpu_convert(g, "pack_f16", source, from, to, words, &[n as u32])
        }
    }
}

/// dst ← the f16 pairs ([`pack_f16`]) of the `n` values `f32_form` writes into scratch (`slot`, split
/// every `unit`): how an op that writes f16 pairs forms them where its own kernel does not apply, and
/// on the CPU twin.
pub(crate) fn pack_f16_of(
    be: &Backend,
    slot: &'static str,
    (n, unit): (usize, usize),
    dst: TMut<'_>,
    f32_form: impl FnOnce(TMut<'_>) -> Result<()>,
) -> Result<()> {
    let mut wide = be.scratch(slot, n, unit)?;
    f32_form((&mut wide).into())?;
    pack_f16(be, (&wide).into(), dst, n)
}

/// Whether an element-wise kernel that takes four values a thread can read the `n` f32 values of each
/// input (tensor, offset) and write their results as pairs at `out`: `n` and every input's offset
/// whole vectors, the output's offset a whole pair of words, every operand in one binding. Where not,
/// the op writes its pairs through [`pack_f16_of`].
pub(crate) fn pairs_in_one_pass(
    n: usize,
    inputs: &[(&GpuTensor, usize)],
    (out, out_offset): (&GpuTensor, usize),
) -> bool {
    n.is_multiple_of(4)
        && out_offset.is_multiple_of(2)
        && out.num_chunks() == 1
        && inputs
            .iter()
            .all(|(t, o)| o.is_multiple_of(4) && t.num_chunks() == 1)
}

/// dst ← the `n` f16 values of src's pairs (starting at its first word) as f32: [`pack_f16`]'s
/// inverse, for kernels that read f32 where an operand is stored packed.
pub fn unpack_f16_to(be: &Backend, src: TRef<'_>, mut dst: TMut<'_>, n: usize) -> Result<()> {
    let words = packed_len(n);
    match be {
        Backend::Cpu(_) => {
            let s = src.cpu_u32("unpack_f16", "src", words)?;
            let d = dst.cpu("unpack_f16", "dst", n)?;
            d.copy_from_slice(&unpack_f16(s, n));
            Ok(())
        }
        Backend::Gpu(g) => {
            let source = include_str!("unpack_f16.wgsl");
            let (from, to) = ((src, words), (dst, n));
            gpu_convert(g, "unpack_f16", source, from, to, n, &[])
        }
    }
}

/// [`pack_f16`]'s or [`unpack_f16_to`]'s kernel (`op`, `source`) from `len` elements of `src` to `len`
/// of `dst`, one thread each of `units`; both in one buffer.
fn gpu_convert(
    g: &GpuBackend,
    op: &'static str,
    source: &str,
    (src, src_len): (TRef<'_>, usize),
    (dst, dst_len): (TMut<'_>, usize),
    units: usize,
    extra: &[u32],
) -> Result<()> {
    let ts = src.gpu(op, "src", src_len)?;
    let td = dst.gpu(op, "dst", dst_len)?;
    if ts.num_chunks() != 1 || td.num_chunks() != 1 {
        return Err(Error::Shape {
            op,
            msg: "f16 packing and unpacking work on tensors in one buffer".into(),
        });
    }
    let pipe = kernel(g, op, source, &[Access::Read, Access::ReadWrite])?;
    let ops = [
        Operand::whole(ts, src.offset(), src_len),
        Operand::whole(td, dst.offset(), dst_len),
    ];
    run(g, op, &pipe, units, &ops, extra, Grid::Threads(256))
}

/// Unpacks f16 pairs (the CPU twin's view of a packed weight).
pub fn unpack_f16(words: &[u32], n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| half::f16::from_bits((words[i / 2] >> (16 * (i % 2))) as u16).to_f32())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::matmul::{Gemm, Weights, matmul};
    use crate::path::{PathId, PathSet};
    use crate::rng::SeedRng;
    use crate::testing::{Arg, check_twin};

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
                matmul(
                    be,
                    PathSet::of(&[PathId::F16Storage]),
                    (&*tx).into(),
                    Weights::F16((&*tp).into()),
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
