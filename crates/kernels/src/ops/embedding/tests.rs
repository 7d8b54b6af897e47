use super::*;
use crate::ops::Grad;
use crate::testing::{Arg, SeedRng, check_twin};

#[test]
fn embedding_forward_and_backward_match_twin() {
    let mut rng = SeedRng::new(70);
    let (vocab, dim, period) = (37, 24, 5);
    let n = 23;
    let mut ids: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
    ids[3] = ids[7]; // repeated ids accumulate
    let tab = rng.vec(vocab * dim, -1.0, 1.0);
    let pos = rng.vec(8 * dim, -1.0, 1.0);
    let dout = rng.vec(n * dim, -1.0, 1.0);
    let dtab0 = rng.vec(vocab * dim, -1.0, 1.0);
    let s = EmbedShape {
        tokens: n,
        vocab,
        dim,
        scale: 1.5,
    };
    let args = [
        Arg::words(&ids, 1),
        Arg::data(tab, dim),
        Arg::data(pos, dim),
        Arg::out(n * dim, dim),
        Arg::data(dout.clone(), dim),
        Arg::out(vocab * dim, dim),
        Arg::out(period * dim, dim),
        Arg::data(dtab0.clone(), dim),
    ];
    // Chunks of 600 elements: the table (888) splits at row 25, so lookups and scatter-adds cross
    // buffers; the token gradients (552) stay in one buffer, as the backward pass requires.
    let out = check_twin("embedding", 1e-12, &args, Some(2400), |be, t| {
        let [ti, tt, tp, to, td, tdt, tdp, tdt2] = t else {
            unreachable!()
        };
        let positions = Positions {
            table: (&*tp).into(),
            rows: 8,
            period,
            pos0: 2,
        };
        embedding(
            be,
            (&*ti).into(),
            (&*tt).into(),
            Some(positions),
            to.into(),
            s,
        )?;
        let mut index = GradIndex::new(be, n, vocab)?;
        index.set(be, &ids)?;
        embedding_backward(
            be,
            &index,
            (&*td).into(),
            tdt.into(),
            Some((tdp.into(), period)),
            s,
            Grad::Overwrite,
        )?;
        embedding_backward(
            be,
            &index,
            (&*td).into(),
            tdt2.into(),
            None,
            s,
            Grad::Accumulate,
        )
    });
    // Row 3 and row 7 share an id: that table row's gradient is scale * (dout[3] + dout[7] + others).
    let id = ids[3] as usize;
    let mut want = vec![0.0f32; dim];
    for (i, &t) in ids.iter().enumerate() {
        if t as usize == id {
            want.iter_mut()
                .zip(&dout[i * dim..][..dim])
                .for_each(|(w, d)| *w += 1.5 * d);
        }
    }
    for c in 0..dim {
        assert!((out[5][id * dim + c] - want[c]).abs() < 1e-5);
        assert!((out[7][id * dim + c] - dtab0[id * dim + c] - want[c]).abs() < 1e-5);
    }
}

#[test]
fn out_of_vocabulary_ids_are_refused_by_the_gradient_index() {
    let be = crate::testing::cpu_backend();
    let mut index = GradIndex::new(&be, 4, 10).unwrap();
    assert!(index.set(&be, &[1, 2, 10]).is_err());
    assert!(index.set(&be, &[1, 2, 3, 4, 5]).is_err());
}
