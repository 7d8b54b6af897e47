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
