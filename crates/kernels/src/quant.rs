//! Kernel-side layouts of block-quantized weight matrices.
//!
//! The kernels know nothing about file formats. A caller (the `formats` crate, for GGUF) separates each
//! format's blocks into the plain arrays below; every supported GGUF type maps onto one of these two layouts
//! *exactly* (the dequantized values are bit-identical to the format's own dequantization), so one GPU
//! kernel and one CPU dot product per layout serve many file formats.
//!
//! A matrix has `rows` (N, output features) and `cols` (K, input features, the reduction dimension);
//! blocks run along K inside one row, so `cols` must be a multiple of the block size.

/// Signed 8-bit quants with one f32 scale per block of `block` consecutive values of a row.
///
/// value(r, k) = scales[(r * cols + k) / block] * q(r, k), with q in -128..=127.
///
/// Quants are packed four per `u32`, little-endian: value k of the matrix's flat row-major order sits in
/// byte `k % 4` of word `k / 4`, as two's complement (the kernels sign-extend explicitly).
///
/// ```text
///   word w:  | byte0: q[4w] | byte1: q[4w+1] | byte2: q[4w+2] | byte3: q[4w+3] |
/// ```
///
/// Formats that map here: Q8_0 (block 32), Q5_0 (block 32, q - 16), Q6_K (block 16, scale d*sc, q - 32).
#[derive(Clone, Debug, PartialEq)]
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// 16 or 32.
    pub block: usize,
    /// `rows * cols / block` scales.
    pub scales: Vec<f32>,
    /// `rows * cols / 4` words.
    pub quants: Vec<u32>,
}

/// Unsigned 4-bit quants with an f32 scale and an f32 offset per block of 32 values of a row.
///
/// value(r, k) = scales[b] * q(r, k) + mins[b], with b = (r * cols + k) / 32 and q in 0..=15.
///
/// Each block's 32 quants occupy 16 bytes (4 words), in GGUF's Q4_0/Q4_1 order: byte j (0..16) of the
/// block holds value j in its low nibble and value j + 16 in its high nibble; bytes are little-endian
/// inside each word.
///
/// ```text
///   block (16 bytes): | b0: q0 | q16 | b1: q1 | q17 | ... | b15: q15 | q31 |   (low nibble first)
/// ```
///
/// Formats that map here: Q4_0 (min = -8 d), Q4_1, Q4_K (scale d*sc, min -dmin*m per 32 values).
#[derive(Clone, Debug, PartialEq)]
pub struct Q4Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols / 32` scales.
    pub scales: Vec<f32>,
    /// `rows * cols / 32` offsets.
    pub mins: Vec<f32>,
    /// `rows * cols / 8` words.
    pub quants: Vec<u32>,
}

/// Sign-extends byte `i` (0..4) of a packed word.
#[inline]
pub fn unpack_i8(word: u32, i: usize) -> i32 {
    ((word >> (8 * i)) as u8) as i8 as i32
}

impl Q8Matrix {
    /// Dequantizes row `r` into `out` (length `cols`): the f32 twin every Q8 kernel is checked against.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let base = r * self.cols;
        for (k, o) in out.iter_mut().enumerate() {
            let i = base + k;
            *o = self.scales[i / self.block] * unpack_i8(self.quants[i / 4], i % 4) as f32;
        }
    }

    /// The whole matrix as row-major f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }
}

impl Q4Matrix {
    /// The 4-bit quant of flat index `i`.
    #[inline]
    pub fn quant(&self, i: usize) -> u32 {
        let block = i / 32;
        let j = i % 32;
        let byte = j % 16;
        let word = self.quants[block * 4 + byte / 4];
        let b = (word >> (8 * (byte % 4))) & 0xff;
        if j < 16 { b & 0xf } else { b >> 4 }
    }

    /// Dequantizes row `r` into `out` (length `cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let base = r * self.cols;
        for (k, o) in out.iter_mut().enumerate() {
            let i = base + k;
            let b = i / 32;
            *o = self.scales[b] * self.quant(i) as f32 + self.mins[b];
        }
    }

    /// The whole matrix as row-major f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }
}
