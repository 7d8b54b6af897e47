//! Twin tests of the small element-wise ops (larger ops keep their tests in their own folders).

use crate::backend::Backend;
use crate::ops::{add, fill};
use crate::testing::{Arg, SeedRng, check_twin};

#[test]
fn fill_copy_add_match_their_twins() {
    let mut rng = SeedRng::new(10);
    for n in [1usize, 255, 256, 257, 10_001] {
        let a = rng.vec(n, -2.0, 2.0);
        let b = rng.vec(n, -2.0, 2.0);
        let args = [
            Arg::data(a.clone(), 1),
            Arg::data(b.clone(), 1),
            Arg::out(n, 1),
            Arg::data(a.clone(), 1),
            Arg::out(n + 3, 1),
        ];
        let out = check_twin("add", 0.0, &args, Some(1024), |be: &Backend, t| {
            let [ta, tb, tc, td, te] = t else {
                unreachable!()
            };
            add::add(be, (&*ta).into(), (&*tb).into(), tc.into(), n, -0.5)?;
            add::add_assign(be, td.into(), (&*tb).into(), n, 2.0)?;
            fill::fill(be, te.into(), n + 3, 7.0)?;
            fill::copy(be, (&*ta).into(), te.at_mut(2), n)
        });
        for i in 0..n {
            assert_eq!(out[2][i], a[i] - 0.5 * b[i]);
            assert_eq!(out[3][i], a[i] + 2.0 * b[i]);
            assert_eq!(out[4][i + 2], a[i]);
        }
        assert_eq!(&out[4][..2], &[7.0, 7.0]);
        assert_eq!(out[4][n + 2], 7.0);
    }
}

/// A column block of one matrix into another: the last source row may end before the tensor's stride
/// does (a fused projection's K slice), rows split across buffers move whole, nothing else is written.
#[test]
fn copy_rows_moves_a_column_block_and_nothing_else() {
    let mut rng = SeedRng::new(11);
    // (rows, cols, ld_src, src offset, ld_dst, dst offset, split bytes)
    for (rows, cols, ld_src, o_src, ld_dst, o_dst, split) in [
        (1, 5, 7, 2, 5, 0, None),
        (3, 4, 9, 5, 6, 1, None),
        (70, 33, 40, 7, 100, 60, None),
        (300, 64, 192, 128, 64, 0, None),
        (130, 24, 48, 0, 32, 0, Some(48 * 4 * 5)),
    ] {
        let a = rng.vec(rows * ld_src, -2.0, 2.0);
        let args = [
            Arg::data(a.clone(), ld_src),
            Arg::out(rows * ld_dst, ld_dst),
        ];
        let out = check_twin("copy_rows", 0.0, &args, split, |be: &Backend, t| {
            let [ta, tb] = t else { unreachable!() };
            fill::fill(be, tb.into(), rows * ld_dst, 9.0)?;
            fill::copy_rows(
                be,
                ta.at(o_src),
                ld_src,
                tb.at_mut(o_dst),
                ld_dst,
                rows,
                cols,
            )
        });
        let mut want = vec![9.0; rows * ld_dst];
        for r in 0..rows {
            for c in 0..cols {
                want[o_dst + r * ld_dst + c] = a[o_src + r * ld_src + c];
            }
        }
        assert_eq!(out[1], want, "{rows} rows of {cols}");
    }
}

#[test]
fn copy_rows_refuses_rows_wider_than_their_stride() {
    let be = crate::testing::cpu_backend();
    let a = be.from_f32(&[1.0; 12], 1).unwrap();
    let mut b = be.zeros(12, 1).unwrap();
    let e = fill::copy_rows(&be, a.at(0), 3, b.at_mut(0), 6, 2, 4).unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
}

/// A read detached from its backend is finished on another thread, with the values the work before it
/// left — not those of work recorded after it (the drift guard's shadow finishes its checks' reads
/// while the device goes on) — on the CPU and on a GPU whose tensors split across buffers.
#[test]
fn a_detached_read_sees_the_work_before_it_from_another_thread() {
    let n = 3000;
    let mut backends = vec![Backend::Cpu(crate::cpu::CpuBackend::new(Some(1)))];
    backends.extend(crate::testing::gpu_backend(Some(4096)));
    for be in &backends {
        let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
        let mut t = be.from_f32(&data, 1).unwrap();
        let read = be
            .read_start_many(&[(t.at(1000), 1500), (t.at(10), 3)])
            .unwrap();
        let detached = be.read_detach(read).unwrap();
        fill::fill(be, (&mut t).into(), n, 1.0).unwrap();
        be.flush().unwrap();
        let views = std::thread::spawn(move || {
            pollster::block_on(detached.finish_many_f32(&[1500, 3])).unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(views[0], data[1000..2500]);
        assert_eq!(views[1], data[10..13]);
        assert_eq!(be.to_vec(&t).unwrap(), vec![1.0; n]);
    }
}
