// "lowbias32" integer hash (Chris Wellons' hash-prospector), as in dropout/mod.rs.
fn hash(v: u32) -> u32 {
  var h = v;
  h = h ^ (h >> 16u);
  h = h * 0x7feb352du;
  h = h ^ (h >> 15u);
  h = h * 0x846ca68bu;
  h = h ^ (h >> 16u);
  return h;
}
