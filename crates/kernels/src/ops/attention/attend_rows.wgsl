// Decode attention: each query row against its own sequence's rows of a shared KV cache, for the rows of
// several sequences at once (a server's batch) in one dispatch. Row r's table entry [base, pos] says
// its keys and values are cache rows base .. base + pos (position pos is the row's own, written just
// before) and that it sees positions first ..= pos (first > 0 with a sliding window).
//
// Flash decoding: one workgroup per (row, KV head, up to GMAX of the query heads that share it, split of
// CHUNK positions, along y), so K and V rows are read once for the group's heads and even short contexts
// spread over many workgroups; every step is a few loads deep (a decode step is bound by latency):
//
//   scores   8 threads per position, each a strided quarter.. eighth of the dot products (coalesced
//            16-byte loads), summed by a 3-level tree
//   softmax  max and sum over the CHUNK positions for the GMAX heads at once (vec4 trees)
//   values   lane = lid % (head_dim / 4) takes 4 dimensions, lid / (head_dim / 4) every NJ-th position,
//            then the NJ partial sums are added
//
// With one split the row's output is written normalised; with several, each split writes its partial
// (max, sum of exponentials, unnormalised output) and attend_combine.wgsl merges them.
//
// Two forms (rows.rs picks one, see ops/common.rs's form_lines): `#loop ` lines load each key and value
// vector as the loop reaches it; `#up ` lines (GPUs, one scoring step: CHUNK <= WG / TPP) write the
// loops out, `$c` lines once per vector of a thread's scores and `$v` lines once per position of its
// values, and issue every one of those loads as soon as the row's table entry is read: they are in
// flight while the queries are normed and rotated, and the scores, softmax and weighted sum only add.
// The sums are added in the same order in both forms. Both forms issue the queries' loads before the
// table's, and the rotation table's before the norms.
//
// FRESH (the new rows' variant): q is the Q/K/V product's output as it left the product, rows ld_q
// apart, the row's own key and value heads at o_kn / o_vn of its row. Each workgroup then does what
// rope_cache.wgsl does before it: the query heads' RMSNorm (optional) and rotation as they are staged,
// and in the split holding the row's own position the key head's norm and rotation; that key and the
// value are used from workgroup memory and written to the cache row by the head group's first workgroup
// (no workgroup of the dispatch reads that row from the cache). The key head is normed and rotated in
// the same trees and steps as the query heads. The norms are rope_cache.wgsl's tree
// (ops/common.rs's reduce_sum over 256 threads, thread d holding dimension d: four heads in the four
// lanes of a vec4) and the rotation its a·c − b·s, a·s + b·c, so the values are the ones rope_cache
// would have written.
struct Params { rows: u32, heads: u32, kv_heads: u32, head_dim: u32, ld_q: u32, ld_kv: u32, ld_o: u32,
                window: u32, scale: f32, softcap: f32, o_q: u32, o_k: u32, o_v: u32, o_out: u32,
                o_tab: u32, lo_row: u32, hi_row: u32, n_split: u32, o_part: u32, groups: u32,
                o_kn: u32, o_vn: u32, n_rot: u32, neox: u32, o_rope: u32, norm: u32, o_qw: u32,
                o_kw: u32, eps: f32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read_write> kv: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> tab: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> part: array<f32>;
@group(0) @binding(6) var<storage, read> rope: array<f32>;
@group(0) @binding(7) var<storage, read> qw: array<f32>;
@group(0) @binding(8) var<storage, read> kw: array<f32>;

// rows.rs prepends CHUNK (positions per workgroup), FRESH and rope_pair (ops/rope, ROPE_PAIR).
const WG: u32 = 256u;
const TPP: u32 = 8u;                               // threads per position in the scores
const GMAX: u32 = 4u;
var<workgroup> qs: array<vec4<f32>, 256>;          // GMAX heads x head_dim / 4 (head_dim <= 256)
var<workgroup> ps: array<vec4<f32>, CHUNK>;        // the GMAX heads' scores, then probabilities
var<workgroup> red: array<vec4<f32>, WG>;
var<workgroup> redk: array<vec4<f32>, WG>;         // FRESH: the key head's norm and rotation
var<workgroup> kn: array<f32, 256>;                // FRESH: the row's own key and value head
var<workgroup> vn: array<f32, 256>;
var<workgroup> wbase: u32;
var<workgroup> wpos: u32;

// FRESH: the four lanes of x (dimension d of four heads) RMS-normed over head_dim with weight wx, and
// where `both` k (the key head, in its first lane) with weight wk, in the same steps, as rope_cache.wgsl
// norms each head; every thread of the workgroup calls it (`both` the same for all).
fn norm4(x: vec4<f32>, k: vec4<f32>, wx: f32, wk: f32, both: bool, lid: u32) -> array<vec4<f32>, 2> {
  red[lid] = x * x;
  if (both) { redk[lid] = k * k; }
  workgroupBarrier();
  for (var s = WG / 2u; s > 0u; s = s >> 1u) {
    if (lid < s) {
      red[lid] = red[lid] + red[lid + s];
      if (both) { redk[lid] = redk[lid] + redk[lid + s]; }
    }
    workgroupBarrier();
  }
  let ss = red[0];
  let sk = redk[0];
  workgroupBarrier();
  let rstd = 1.0 / sqrt(ss * (1.0 / f32(p.head_dim)) + p.eps);
  let rk = 1.0 / sqrt(sk * (1.0 / f32(p.head_dim)) + p.eps);
  return array<vec4<f32>, 2>(x * rstd * wx, k * rk * wk);
}

// FRESH: dimension d (= lid) of the four heads of x, and where `both` of the key head k, rotated by
// the position's cosine c and sine s of d's pair; every thread calls it.
fn rotate4(x: vec4<f32>, k: vec4<f32>, both: bool, d: u32, c: f32, s: f32) -> array<vec4<f32>, 2> {
  red[d] = x;
  if (both) { redk[d] = k; }
  workgroupBarrier();
  var y = x;
  var yk = k;
  if (d < p.n_rot) {
    let pr = rope_pair(d, p.n_rot, p.neox != 0u);
    let b = red[pr.partner];
    if (pr.first) { y = x * c - b * s; } else { y = b * s + x * c; }
    if (both) {
      let bk = redk[pr.partner];
      if (pr.first) { yk = k * c - bk * s; } else { yk = bk * s + k * c; }
    }
  }
  workgroupBarrier();
  return array<vec4<f32>, 2>(y, yk);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let gx = wid.x + wid.z * nwg.x;
  let per_row = p.kv_heads * p.groups;
  if (gx >= p.rows * per_row) { return; }
  let r = gx / per_row;
  let kvh = (gx % per_row) / p.groups;
  let gq = gx % p.groups;
  let group = p.heads / p.kv_heads;
  let h0 = kvh * group + gq * GMAX;
  let nh = min(GMAX, group - gq * GMAX);
  // FRESH: thread d holds dimension d of the group's query heads, and (used in the split holding the
  // row's own position) of the key head (its first lane) and the value head.
  let d = lid;
  let in_head = d < p.head_dim;
  var x = vec4<f32>(0.0);
  var k = vec4<f32>(0.0);
  var v = 0.0;
  var wq = 0.0;
  var wk = 0.0;
  if (FRESH && in_head) {
    let qb = p.o_q + r * p.ld_q + h0 * p.head_dim + d;
    for (var g = 0u; g < nh; g = g + 1u) { x[g] = q[qb + g * p.head_dim]; }
    k.x = q[p.o_kn + r * p.ld_q + kvh * p.head_dim + d];
    v = q[p.o_vn + r * p.ld_q + kvh * p.head_dim + d];
    if (p.norm != 0u) {
      wq = qw[p.o_qw + d];
      wk = kw[p.o_kw + d];
    }
  }
  // Through workgroup memory, so the compiler knows every thread sees the same values.
  if (lid == 0u) {
    wbase = tab[p.o_tab + 2u * r];
    wpos = tab[p.o_tab + 2u * r + 1u];
  }
  let base = workgroupUniformLoad(&wbase);
  let pos = workgroupUniformLoad(&wpos);
  // Rows of other cache buffers are another dispatch's.
  if (base < p.lo_row || base >= p.hi_row) { return; }
  var first = 0u;
  if (p.window > 0u && pos + 1u > p.window) { first = pos + 1u - p.window; }
  let lo = first + wid.y * CHUNK;
  let hi = min(lo + CHUNK, pos + 1u);
  let hd4 = p.head_dim / 4u;
  let stride = p.head_dim + 2u;
  if (lo >= hi) {
    // An empty split (rows of a batch differ in length): nothing to merge.
    if (lid < nh) {
      let at = p.o_part + ((r * p.heads + h0 + lid) * p.n_split + wid.y) * stride;
      // -inf from a variable: a constant expression of it is an error in WGSL (Tint refuses it).
      var ninf_bits = 0xff800000u;
      part[at] = bitcast<f32>(ninf_bits);
      part[at + 1u] = 0.0;
    }
    return;
  }
  let ld4 = p.ld_kv / 4u;
  let row0 = base + lo - p.lo_row;
  // FRESH: this split holds the row's own position (the last split: hi is pos + 1).
  let own = FRESH && hi == pos + 1u;
  let jown = pos - lo;
  // The scores' thread: position lo + lid / TPP, dimensions t, t + TPP, ... (vec4s); the values':
  // dimensions 4·lane .. 4·lane + 3 of every NJ-th position from jg.
  let t = lid % TPP;
  let nj = WG / hd4;
  let lane = lid % hd4;
  let jg = lid / hd4;
  // FRESH: the rotation's cosine and sine for d's pair at the row's position.
  var rc = 0.0;
  var rs = 0.0;
  if (FRESH && d < p.n_rot) {
    let pr = rope_pair(d, p.n_rot, p.neox != 0u);
    let at = p.o_rope + (pos * (p.n_rot / 2u) + pr.i) * 2u;
    rc = rope[at];
    rs = rope[at + 1u];
  }
#up  let kb = p.o_k / 4u + (row0 + lid / TPP) * ld4 + kvh * hd4;
#up  let kin = lo + lid / TPP < hi;
#up  let c$c = t + $cu * TPP;
#up  var k$c = vec4<f32>(0.0);
#up  if (kin && c$c < hd4) { k$c = kv[kb + c$c]; }
#up  let vb = p.o_v / 4u + row0 * ld4 + kvh * hd4 + lane;
#up  let jj$v = jg + $vu * nj;
#up  let in$v = jg < nj && jj$v < hi - lo;
#up  var v$v = vec4<f32>(0.0);
#up  if (in$v) { v$v = kv[vb + jj$v * ld4]; }
  if (FRESH) {
    // The key is normed and rotated alongside the queries.
    if (p.norm != 0u) {
      let n = norm4(x, k, wq, wk, own, lid);
      x = n[0];
      k = n[1];
    }
    let rot = rotate4(x, k, own, d, rc, rs);
    red[d] = rot[0];
    if (own && in_head) {
      kn[d] = rot[1].x;
      vn[d] = v;
    }
    workgroupBarrier();
    // Into qs's layout: head g's dimensions 4c .. 4c + 3 in qs[g·hd4 + c].
    for (var i = lid; i < nh * hd4; i = i + WG) {
      let g = i / hd4;
      let c = 4u * (i % hd4);
      qs[i] = vec4<f32>(red[c][g], red[c + 1u][g], red[c + 2u][g], red[c + 3u][g]);
    }
  } else {
    for (var i = lid; i < nh * hd4; i = i + WG) {
      let g = i / hd4;
      let qb = p.o_q + r * p.ld_q + (h0 + g) * p.head_dim + 4u * (i % hd4);
      qs[i] = vec4<f32>(q[qb], q[qb + 1u], q[qb + 2u], q[qb + 3u]);
    }
  }
  workgroupBarrier();
  // The row's own key and value go to its cache row, once per KV head; this dispatch reads them from
  // workgroup memory.
  if (own && gq == 0u && lid < hd4) {
    let c = 4u * lid;
    let at = (row0 + jown) * ld4 + kvh * hd4 + lid;
    kv[p.o_k / 4u + at] = vec4<f32>(kn[c], kn[c + 1u], kn[c + 2u], kn[c + 3u]);
    kv[p.o_v / 4u + at] = vec4<f32>(vn[c], vn[c + 1u], vn[c + 2u], vn[c + 3u]);
  }

  // Scores: positions lo + j, j = lid / TPP, lid / TPP + WG / TPP, ...: TPP threads each, each thread
  // dimensions t, t + TPP, ... (vec4s), summed by a tree over the TPP threads.
  var ninf_bits = 0xff800000u;
  let ninf = bitcast<f32>(ninf_bits);
  for (var j0 = 0u; j0 < CHUNK; j0 = j0 + WG / TPP) {
    let j = j0 + lid / TPP;
    var acc = vec4<f32>(0.0);
    if (lo + j < hi) {
#loop      let kb = p.o_k / 4u + (row0 + j) * ld4 + kvh * hd4;
      let fresh = own && j == jown;
#loop      for (var c = t; c < hd4; c = c + TPP) {
#loop        var k4: vec4<f32>;
#loop        if (fresh) {
#loop          k4 = vec4<f32>(kn[4u * c], kn[4u * c + 1u], kn[4u * c + 2u], kn[4u * c + 3u]);
#loop        } else {
#loop          k4 = kv[kb + c];
#loop        }
#loop        acc.x = acc.x + dot(qs[c], k4);
#loop        acc.y = acc.y + dot(qs[hd4 + c], k4);
#loop        acc.z = acc.z + dot(qs[2u * hd4 + c], k4);
#loop        acc.w = acc.w + dot(qs[3u * hd4 + c], k4);
#loop      }
#up      if (c$c < hd4 && fresh) { k$c = vec4<f32>(kn[4u * c$c], kn[4u * c$c + 1u], kn[4u * c$c + 2u], kn[4u * c$c + 3u]); }
#up      if (c$c < hd4) { acc.x = acc.x + dot(qs[c$c], k$c); acc.y = acc.y + dot(qs[hd4 + c$c], k$c); acc.z = acc.z + dot(qs[2u * hd4 + c$c], k$c); acc.w = acc.w + dot(qs[3u * hd4 + c$c], k$c); }
    }
    red[lid] = acc;
    workgroupBarrier();
    for (var s = TPP / 2u; s > 0u; s = s >> 1u) {
      if (t < s) { red[lid] = red[lid] + red[lid + s]; }
      workgroupBarrier();
    }
    if (t == 0u && j < CHUNK) {
      var sc = red[lid] * p.scale;
      if (p.softcap > 0.0) { sc = p.softcap * tanh(clamp(sc / p.softcap, vec4<f32>(-15.0), vec4<f32>(15.0))); }
      if (lo + j >= hi) { sc = vec4<f32>(ninf); }
      ps[j] = sc;
    }
    workgroupBarrier();
  }
  // Softmax over the chunk: max, then exponentials and their sum (trees over CHUNK positions).
  if (lid < CHUNK) { red[lid] = ps[lid]; }
  workgroupBarrier();
  for (var s = CHUNK / 2u; s > 0u; s = s >> 1u) {
    if (lid < s) { red[lid] = max(red[lid], red[lid + s]); }
    workgroupBarrier();
  }
  let m = red[0];
  workgroupBarrier();
  if (lid < CHUNK) {
    var e = vec4<f32>(0.0);
    if (lo + lid < hi) { e = exp(ps[lid] - m); }
    ps[lid] = e;
    red[lid] = e;
  }
  workgroupBarrier();
  for (var s = CHUNK / 2u; s > 0u; s = s >> 1u) {
    if (lid < s) { red[lid] = red[lid] + red[lid + s]; }
    workgroupBarrier();
  }
  let l = red[0];
  workgroupBarrier();

  // Values: lane takes dimensions 4·lane .. 4·lane + 3; its position group every NJ-th position.
  var a0 = vec4<f32>(0.0);
  var a1 = vec4<f32>(0.0);
  var a2 = vec4<f32>(0.0);
  var a3 = vec4<f32>(0.0);
  if (jg < nj) {
#loop    for (var jj = jg; jj < hi - lo; jj = jj + nj) {
#loop      var v4: vec4<f32>;
#loop      if (own && jj == jown) {
#loop        let c = 4u * lane;
#loop        v4 = vec4<f32>(vn[c], vn[c + 1u], vn[c + 2u], vn[c + 3u]);
#loop      } else {
#loop        v4 = kv[p.o_v / 4u + (row0 + jj) * ld4 + kvh * hd4 + lane];
#loop      }
#loop      let w = ps[jj];
#loop      a0 = a0 + w.x * v4;
#loop      a1 = a1 + w.y * v4;
#loop      a2 = a2 + w.z * v4;
#loop      a3 = a3 + w.w * v4;
#loop    }
#up    let fresh$v = own && jj$v == jown;
#up    if (in$v && fresh$v) { v$v = vec4<f32>(vn[4u * lane], vn[4u * lane + 1u], vn[4u * lane + 2u], vn[4u * lane + 3u]); }
#up    if (in$v) { let w = ps[jj$v]; a0 = a0 + w.x * v$v; a1 = a1 + w.y * v$v; a2 = a2 + w.z * v$v; a3 = a3 + w.w * v$v; }
  }
  for (var g = 0u; g < nh; g = g + 1u) {
    var a = a0;
    if (g == 1u) { a = a1; }
    if (g == 2u) { a = a2; }
    if (g == 3u) { a = a3; }
    red[lid] = a;
    workgroupBarrier();
    if (jg == 0u) {
      var s = red[lane];
      for (var u = 1u; u < nj; u = u + 1u) { s = s + red[u * hd4 + lane]; }
      let h = h0 + g;
      if (p.n_split == 1u) {
        let ob = p.o_out + r * p.ld_o + h * p.head_dim + 4u * lane;
        let o = s / l[g];
        out[ob] = o.x;
        out[ob + 1u] = o.y;
        out[ob + 2u] = o.z;
        out[ob + 3u] = o.w;
      } else {
        let at = p.o_part + ((r * p.heads + h) * p.n_split + wid.y) * stride;
        if (lane == 0u) {
          part[at] = m[g];
          part[at + 1u] = l[g];
        }
        part[at + 2u + 4u * lane] = s.x;
        part[at + 3u + 4u * lane] = s.y;
        part[at + 4u + 4u * lane] = s.z;
        part[at + 5u + 4u * lane] = s.w;
      }
    }
    workgroupBarrier();
  }
}
