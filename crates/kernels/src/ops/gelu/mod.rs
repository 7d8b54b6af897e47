//! GELU in its tanh form (GPT-2's MLP activation) and its backward.

use super::common::{FOUR_A_THREAD, FOUR_A_THREAD_MAIN, Grid, PRELUDE, run};
use super::fastmath::{self, map1, map2};
use crate::backend::{Backend, TMut, TRef};
use crate::error::Result;
use crate::gpu::{Access, GpuBackend, Operand, segments};
use crate::ops::matmul::{pack_f16_of, packed_len, pairs_in_one_pass};
use rayon::prelude::*;

const S2PI: f32 = 0.797_884_6;
const K: f32 = 0.044715;

/// The tanh argument, clamped as the kernel does (see gelu.wgsl).
#[inline(always)]
fn inner(x: f32) -> f32 {
    (S2PI * (x + K * x * x * x)).clamp(-15.0, 15.0)
}

/// GELU of one value: the scalar twin (tanh within 3e-7, see [`fastmath`]).
#[inline(always)]
pub fn gelu_scalar(x: f32) -> f32 {
    0.5 * x * (1.0 + fastmath::tanh(inner(x)))
}

/// d GELU / dx.
#[inline(always)]
pub fn gelu_grad_scalar(x: f32) -> f32 {
    let t = fastmath::tanh(inner(x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * S2PI * (1.0 + 3.0 * K * x * x)
}

/// gelu_fns.wgsl's GELU and its derivative on `ty` (`f32`, `vec2<f32>`, ...): the one source of the
/// expressions for [`gelu`], [`gelu_f16`] and the tensor-core training product's GELU epilogues.
pub(crate) fn wgsl_fns(ty: &str) -> String {
    format!("alias GeluV = {ty};\n{}", include_str!("gelu_fns.wgsl"))
}

/// y = gelu(x) over `n` elements.
pub fn gelu(be: &Backend, x: TRef<'_>, y: TMut<'_>, n: usize) -> Result<()> {
    launch(be, x, None, y, n)
}

/// y = GELU(x) rounded to f16 pairs: `n` values into `packed_len(n)` words (the values [`gelu`]
/// computes, each rounded as [`pack_f16`] rounds), for a tensor only the tensor-core training products
/// read (the MLP's activation on that path): half the bytes written, and read by each product.
pub fn gelu_f16(be: &Backend, x: TRef<'_>, y: TMut<'_>, n: usize) -> Result<()> {
    launch_f16(be, x, None, y, n)
}

/// dx = dy · gelu'(x) rounded to f16 pairs, as [`gelu_f16`] rounds [`gelu`]'s values: the gradient at
/// c_fc's output on the tensor-core training path, which only that product's backward products read.
pub fn gelu_backward_f16(
    be: &Backend,
    x: TRef<'_>,
    dy: TRef<'_>,
    dx: TMut<'_>,
    n: usize,
) -> Result<()> {
    launch_f16(be, x, Some(dy), dx, n)
}

/// [`launch`] with its output rounded to f16 pairs: on the GPU by one kernel where every operand is in
/// one binding at whole vectors; elsewhere (and on the CPU twin) the f32 values in scratch, then packed.
fn launch_f16(
    be: &Backend,
    x: TRef<'_>,
    dy: Option<TRef<'_>>,
    y: TMut<'_>,
    n: usize,
) -> Result<()> {
    let words = packed_len(n);
    if let Backend::Gpu(g) = be {
        let tx = x.gpu("gelu", "x", n)?;
        let ty = y.gpu("gelu", "y", words)?;
        let (td, od) = match &dy {
            Some(d) => (d.gpu("gelu", "dy", n)?, d.offset()),
            None => (tx, x.offset()),
        };
        let (ox, oy) = (x.offset(), y.offset());
        if pairs_in_one_pass(n, &[(tx, ox), (td, od)], (ty, oy)) {
            let pipe = g.pipeline(
                "gelu_f16",
                &[Access::Read, Access::Read, Access::ReadWrite],
                || {
                    format!(
                        "{PRELUDE}\n{}{}{FOUR_A_THREAD_MAIN}",
                        wgsl_fns("vec4<f32>"),
                        include_str!("gelu_f16.wgsl")
                    )
                },
            )?;
            let ops = [
                Operand::whole(tx, ox, n),
                Operand::whole(td, od, n),
                Operand::whole(ty, oy, words),
            ];
            let extra = [dy.is_some() as u32];
            return run(
                g,
                "gelu",
                &pipe,
                n / 4,
                &ops,
                &extra,
                Grid::Threads(FOUR_A_THREAD),
            );
        }
    }
    pack_f16_of(be, "gelu_f16", (n, 4), y, |wide| launch(be, x, dy, wide, n))
}

/// dx = dy · gelu'(x) over `n` elements.
pub fn gelu_backward(
    be: &Backend,
    x: TRef<'_>,
    dy: TRef<'_>,
    dx: TMut<'_>,
    n: usize,
) -> Result<()> {
    launch(be, x, Some(dy), dx, n)
}

fn launch(
    be: &Backend,
    x: TRef<'_>,
    dy: Option<TRef<'_>>,
    mut out: TMut<'_>,
    n: usize,
) -> Result<()> {
    match be {
        Backend::Cpu(c) => {
            let xs = x.cpu("gelu", "x", n)?;
            let dys = dy.map(|d| d.cpu("gelu", "dy", n)).transpose()?;
            let o = out.cpu("gelu", "out", n)?;
            const CHUNK: usize = 1 << 14;
            c.install(|| match dys {
                None => o
                    .par_chunks_mut(CHUNK)
                    .zip(xs.par_chunks(CHUNK))
                    .for_each(|(o, x)| map1(o, x, gelu_scalar)),
                Some(d) => o
                    .par_chunks_mut(CHUNK)
                    .zip(xs.par_chunks(CHUNK).zip(d.par_chunks(CHUNK)))
                    .for_each(|(o, (x, d))| map2(o, x, d, |v, g| g * gelu_grad_scalar(v))),
            });
            Ok(())
        }
        Backend::Gpu(g) => gpu_launch(g, x, dy, out, n, true),
    }
}

/// [`launch`] on the GPU: four values a load and a store where every offset (in each binding it
/// lands in) and `n` are multiples of 4 and `vectors` allows, else one (tests compare the two).
fn gpu_launch(
    g: &GpuBackend,
    x: TRef<'_>,
    dy: Option<TRef<'_>>,
    out: TMut<'_>,
    n: usize,
    vectors: bool,
) -> Result<()> {
    let tx = x.gpu("gelu", "x", n)?;
    let (td, od) = match &dy {
        Some(d) => (d.gpu("gelu", "dy", n)?, d.offset()),
        None => (tx, x.offset()),
    };
    let to = out.gpu("gelu", "out", n)?;
    let ops = |lanes: usize| {
        [
            Operand::rows(tx, x.offset(), lanes),
            Operand::rows(td, od, lanes),
            Operand::rows(to, out.offset(), lanes),
        ]
    };
    // Vectors only where every segment's operands start on one (a binding split at an element that
    // is not a multiple of 4 keeps the f32 form).
    let lanes = if vectors
        && n.is_multiple_of(4)
        && segments("gelu", n / 4, &ops(4)).is_ok_and(|segs| {
            segs.iter()
                .all(|s| s.places.iter().all(|pl| pl.offset.is_multiple_of(4)))
        }) {
        4
    } else {
        1
    };
    let (key, v) = if lanes == 4 {
        ("gelu_vec4", "vec4<f32>")
    } else {
        ("gelu", "f32")
    };
    let pipe = g.pipeline(
        key,
        &[Access::Read, Access::Read, Access::ReadWrite],
        || {
            format!(
                "{PRELUDE}\nalias V = {v};\nconst LANES: u32 = {lanes}u;\n{}{}{FOUR_A_THREAD_MAIN}",
                wgsl_fns(v),
                include_str!("gelu.wgsl")
            )
        },
    )?;
    run(
        g,
        "gelu",
        &pipe,
        n / lanes,
        &ops(lanes),
        &[dy.is_some() as u32],
        Grid::Threads(FOUR_A_THREAD),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Arg, SeedRng, check_twin};

    /// The vector form gives the f32 form's bits, forward and backward, at offsets inside a binding
    /// and across split bindings (the f32 form's twin check is the test below).
    #[test]
    fn four_values_a_load_keep_the_bits() {
        let mut rng = SeedRng::new(21);
        for max_binding in [None, Some(4096u64)] {
            let Some(be) = crate::testing::gpu_backend(max_binding) else {
                return;
            };
            let Some(g) = be.as_gpu() else { return };
            for (n, shift) in [(4usize, 0usize), (4104, 4), (5004, 0), (3000, 8)] {
                let x = rng.vec(n + shift, -6.0, 6.0);
                let dy = rng.vec(n + shift, -1.0, 1.0);
                let tx = be.from_f32(&x, 1).unwrap();
                let td = be.from_f32(&dy, 1).unwrap();
                let run = |vectors: bool, backward: bool| {
                    let mut out = crate::testing::poisoned(&be, n + shift, 1).unwrap();
                    let d = backward.then(|| td.at(shift));
                    gpu_launch(g, tx.at(shift), d, out.at_mut(shift), n, vectors).unwrap();
                    be.to_vec(&out).unwrap()[shift..]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>()
                };
                for backward in [false, true] {
                    assert!(
                        run(true, backward) == run(false, backward),
                        "n {n} offset {shift} backward {backward} binding {max_binding:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn gelu_forward_and_backward_match_twin_and_finite_differences() {
        let mut rng = SeedRng::new(20);
        let n = 5003;
        let mut x = rng.vec(n, -6.0, 6.0);
        x[0] = 40.0; // far in the tail: must stay finite
        x[1] = -40.0;
        let dy = rng.vec(n, -1.0, 1.0);
        let args = [
            Arg::data(x.clone(), 1),
            Arg::data(dy.clone(), 1),
            Arg::out(n, 1),
            Arg::out(n, 1),
        ];
        let out = check_twin("gelu", 1e-12, &args, Some(4096), |be, t| {
            let [tx, td, ty, tg] = t else { unreachable!() };
            gelu(be, (&*tx).into(), ty.into(), n)?;
            gelu_backward(be, (&*tx).into(), (&*td).into(), tg.into(), n)
        });
        assert_eq!(out[2][0], 40.0);
        assert_eq!(out[2][1], 0.0);
        // Backward against central differences of the forward twin (in f64 around f32 inputs).
        for i in 2..200 {
            let h = 1e-3f32;
            let fd =
                (gelu_scalar(x[i] + h) as f64 - gelu_scalar(x[i] - h) as f64) / (2.0 * h as f64);
            let an = out[3][i] as f64 / dy[i] as f64;
            assert!((fd - an).abs() < 2e-3, "x={} fd={fd} analytic={an}", x[i]);
        }
    }

    /// The f16-pairs forms (forward and backward) write the f32 forms' values rounded as `pack_f16`
    /// rounds them, bit for bit, whole-vector views and others (an odd count, an offset not a multiple
    /// of four: the f32 values, then packed); the CPU twin does the same with its own GELU. Operands
    /// split across bindings are an error, not a wrong answer.
    #[test]
    fn f16_pairs_hold_the_f32_values_rounded() {
        let mut rng = SeedRng::new(22);
        let mut backends = vec![crate::testing::cpu_backend()];
        backends.extend(crate::testing::gpu_backend(None));
        for be in &backends {
            for (n, shift) in [(4usize, 0usize), (4104, 4), (5001, 0), (3000, 2)] {
                let x = rng.vec(n + shift, -6.0, 6.0);
                let dy = rng.vec(n + shift, -2.0, 2.0);
                let (tx, tdy) = (be.from_f32(&x, 2).unwrap(), be.from_f32(&dy, 2).unwrap());
                for backward in [false, true] {
                    let (x, dy) = (tx.at(shift), tdy.at(shift));
                    let what = format!("{} n {n} shift {shift} backward {backward}", be.kind());
                    crate::testing::assert_f16_pairs(
                        be,
                        n,
                        &what,
                        |w| match backward {
                            false => gelu(be, x, w, n),
                            true => gelu_backward(be, x, dy, w, n),
                        },
                        |y| match backward {
                            false => gelu_f16(be, x, y, n),
                            true => gelu_backward_f16(be, x, dy, y, n),
                        },
                    );
                }
            }
        }
        if let Some(be) = crate::testing::gpu_backend(Some(4096)) {
            let tx = be.from_f32(&rng.vec(4096, -6.0, 6.0), 4).unwrap();
            let mut y = be.zeros_typed(2048, 1, crate::DType::U32).unwrap();
            assert!(gelu_f16(&be, tx.at(0), y.at_mut(0), 4096).is_err());
        }
    }
}
