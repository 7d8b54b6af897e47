// The batch kernels' last part (gemv_rows_*.wgsl; gpu.rs appends it, with LANE_STRIDE: the threads
// between lane l and lane l + 1 of a row of x, 1 in the lanes form, XR in the once form):
// each weight row's lane sums go through the one-row kernel's tree (lane l adds lane l + h, h = TPR/2,
// TPR/4, ..., 1), and lane b of each row of x writes weight row b's output.
  red[$b * WG + lid] = acc$b;
  workgroupBarrier();
  for (var h = TPR / 2u; h > 0u; h = h >> 1u) {
    if (lane < h) {
      red[$b * WG + lid] = red[$b * WG + lid] + red[$b * WG + lid + h * LANE_STRIDE];
    }
    workgroupBarrier();
  }
  if (lane < NB && n0 + lane < p.n && xi < p.m) {
    store(p.o_y + xi * p.ldy + n0 + lane, red[lane * WG + lid - lane * LANE_STRIDE]);
  }
}
