//! Converting GGUF tensor data: to the kernel layouts, to f32, and from f32.
//!
//! A GGUF matrix has `ne[0]` = cols (the fastest-varying dimension, the reduction dimension K of a
//! weight) and `ne[1]` = rows (N); tensors with more dimensions are treated as `ne[1] * ne[2] * ne[3]`
//! rows. Quantization blocks run along a row, so one row is a whole number of blocks.

use tinygpt_kernels::quant::{Q4Matrix, Q8Matrix};

use crate::blocks::{
    Block, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, RepackQ4, RepackQ8,
    float, quantize_blocks,
};
use crate::error::FormatError;
use crate::ggml_type::GgmlType;
use crate::gguf::TensorInfo;

/// A tensor in the layout the kernels consume.
#[derive(Clone, Debug, PartialEq)]
pub enum KernelWeights {
    /// Row-major f32 (from F32, F16 or BF16 tensors), `rows * cols` values.
    F32(Vec<f32>),
    /// From Q8_0 (block 32), Q5_0 (block 32) or Q6_K (block 16).
    Q8(Q8Matrix),
    /// From Q4_0, Q4_1 or Q4_K.
    Q4(Q4Matrix),
}

impl KernelWeights {
    /// The whole tensor as row-major f32, through the kernel layout's own dequantization.
    pub fn dequantize(&self) -> Vec<f32> {
        match self {
            KernelWeights::F32(v) => v.clone(),
            KernelWeights::Q8(m) => m.dequantize(),
            KernelWeights::Q4(m) => m.dequantize(),
        }
    }

    /// The first value that is not finite, and what it is ("value", "block scale" or "block
    /// minimum"): a damaged file (quants are integers, so a layout's only floats are its values or
    /// its blocks' scales and minimums).
    pub fn first_non_finite(&self) -> Option<(&'static str, f32)> {
        let bad = |what, v: &[f32]| v.iter().find(|x| !x.is_finite()).map(|&x| (what, x));
        match self {
            KernelWeights::F32(v) => bad("value", v),
            KernelWeights::Q8(m) => bad("block scale", &m.scales),
            KernelWeights::Q4(m) => {
                bad("block scale", &m.scales).or_else(|| bad("block minimum", &m.mins))
            }
        }
    }

    /// Short name of the layout: `f32`, `q8` or `q4`.
    pub fn layout_name(&self) -> &'static str {
        match self {
            KernelWeights::F32(_) => "f32",
            KernelWeights::Q8(_) => "q8",
            KernelWeights::Q4(_) => "q4",
        }
    }

    /// Bytes of memory the weights take.
    pub fn size_bytes(&self) -> usize {
        match self {
            KernelWeights::F32(v) => v.len() * 4,
            KernelWeights::Q8(m) => (m.scales.len() + m.quants.len()) * 4,
            KernelWeights::Q4(m) => (m.scales.len() + m.mins.len() + m.quants.len()) * 4,
        }
    }
}

/// Converts one tensor's raw bytes to its kernel layout. Every supported mapping is exact: the layout's
/// `dequantize()` reproduces [`dequantize_tensor`] bit for bit for finite block scales (Q4_0 up to the
/// sign of zero results, see [`crate::blocks::q4_0`]).
///
/// | GGUF type        | layout                                         |
/// |------------------|------------------------------------------------|
/// | F32, F16, BF16   | `F32`                                          |
/// | Q8_0             | `Q8Matrix`, block 32                           |
/// | Q5_0             | `Q8Matrix`, block 32, q - 16                   |
/// | Q6_K             | `Q8Matrix`, block 16, scale d*sc, q - 32       |
/// | Q4_0             | `Q4Matrix`, scale d, offset -8d                |
/// | Q4_1             | `Q4Matrix`, scale d, offset m                  |
/// | Q4_K             | `Q4Matrix`, scale d*sc, offset -dmin*m per 32  |
///
/// Other types give [`FormatError::UnsupportedType`].
pub fn load_matrix(info: &TensorInfo, bytes: &[u8]) -> Result<KernelWeights, FormatError> {
    let (rows, cols) = shape(info, bytes)?;
    Ok(match info.ggml_type {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let mut out = vec![0.0; rows * cols];
            decode_floats(info.ggml_type, bytes, &mut out);
            KernelWeights::F32(out)
        }
        GgmlType::Q8_0 => {
            KernelWeights::Q8(repack_q8(blocks::<BlockQ8_0>(info, bytes)?, rows, cols))
        }
        GgmlType::Q5_0 => {
            KernelWeights::Q8(repack_q8(blocks::<BlockQ5_0>(info, bytes)?, rows, cols))
        }
        GgmlType::Q6_K => {
            KernelWeights::Q8(repack_q8(blocks::<BlockQ6K>(info, bytes)?, rows, cols))
        }
        GgmlType::Q4_0 => {
            KernelWeights::Q4(repack_q4(blocks::<BlockQ4_0>(info, bytes)?, rows, cols))
        }
        GgmlType::Q4_1 => {
            KernelWeights::Q4(repack_q4(blocks::<BlockQ4_1>(info, bytes)?, rows, cols))
        }
        GgmlType::Q4_K => {
            KernelWeights::Q4(repack_q4(blocks::<BlockQ4K>(info, bytes)?, rows, cols))
        }
        other => {
            return Err(FormatError::UnsupportedType {
                tensor: info.name.clone(),
                ggml_type: other,
                operation: "loading into a kernel layout",
            });
        }
    })
}

/// The whole tensor dequantized to row-major f32 with the reference twins.
pub fn dequantize_tensor(info: &TensorInfo, bytes: &[u8]) -> Result<Vec<f32>, FormatError> {
    let (rows, cols) = shape(info, bytes)?;
    supported_for_f32(info)?;
    let mut out = vec![0.0; rows * cols];
    dequantize_into(info.ggml_type, bytes, &mut out);
    Ok(out)
}

/// Dequantizes row `row` alone into `out` (which must hold exactly `cols` values). Only that row's bytes
/// are read, which makes this the cheap path for embedding lookups in a memory-mapped file.
pub fn dequantize_row(
    info: &TensorInfo,
    bytes: &[u8],
    row: u64,
    out: &mut [f32],
) -> Result<(), FormatError> {
    let (rows, cols) = shape(info, bytes)?;
    supported_for_f32(info)?;
    if row >= rows as u64 {
        return Err(FormatError::TensorShape {
            tensor: info.name.clone(),
            detail: format!("row {row} out of range (the tensor has {rows} rows)"),
        });
    }
    if out.len() != cols {
        return Err(FormatError::TensorShape {
            tensor: info.name.clone(),
            detail: format!(
                "output row holds {} values, the tensor has {cols} columns",
                out.len()
            ),
        });
    }
    // shape() checked bytes.len() == rows * row_bytes, so this slice is in bounds.
    let row_bytes = bytes.len() / rows;
    let start = row as usize * row_bytes;
    dequantize_into(info.ggml_type, &bytes[start..start + row_bytes], out);
    Ok(())
}

/// Encodes f32 values (a whole number of blocks, every value finite) as `ggml_type`: F32, F16, BF16,
/// Q8_0, Q4_0, Q4_1, Q5_0, Q4_K or Q6_K.
pub fn quantize(ggml_type: GgmlType, values: &[f32]) -> Result<Vec<u8>, FormatError> {
    let block = ggml_type.block_size();
    if !values.len().is_multiple_of(block) {
        return Err(FormatError::Quantize {
            ggml_type,
            detail: format!(
                "{} values are not a whole number of {block}-value blocks",
                values.len()
            ),
        });
    }
    fn encode<B: Block>(values: &[f32]) -> Vec<u8> {
        bytemuck::cast_slice(&quantize_blocks::<B>(values)).to_vec()
    }
    Ok(match ggml_type {
        GgmlType::F32 => float::f32_to_bytes(values),
        GgmlType::F16 => float::f32_to_f16_bytes(values),
        GgmlType::BF16 => float::f32_to_bf16_bytes(values),
        GgmlType::Q8_0 => encode::<BlockQ8_0>(values),
        GgmlType::Q4_0 => encode::<BlockQ4_0>(values),
        GgmlType::Q4_1 => encode::<BlockQ4_1>(values),
        GgmlType::Q5_0 => encode::<BlockQ5_0>(values),
        GgmlType::Q4_K => encode::<BlockQ4K>(values),
        GgmlType::Q6_K => encode::<BlockQ6K>(values),
        other => {
            return Err(FormatError::Quantize {
                ggml_type: other,
                detail: format!(
                    "no quantizer for ggml type {} ({})",
                    other as u32,
                    other.name()
                ),
            });
        }
    })
}

/// Decodes the `n` values that [`quantize`] encoded as `bytes` of `ggml_type`, with the reference
/// twins (what a reader of the file will compute with).
pub fn dequantize_bytes(
    ggml_type: GgmlType,
    bytes: &[u8],
    n: usize,
) -> Result<Vec<f32>, FormatError> {
    if !ggml_type.can_dequantize() {
        return Err(FormatError::Quantize {
            ggml_type,
            detail: "no dequantizer for this type".into(),
        });
    }
    if ggml_type.bytes_for(n as u64) != Some(bytes.len() as u64) {
        return Err(FormatError::Quantize {
            ggml_type,
            detail: format!("{} bytes do not hold {n} values", bytes.len()),
        });
    }
    let mut out = vec![0.0; n];
    dequantize_into(ggml_type, bytes, &mut out);
    Ok(out)
}

/// Repacks blocks covering a `rows x cols` row-major matrix into a `Q8Matrix`.
///
/// Panics if the blocks do not cover exactly `rows * cols` values or `cols` is not a whole number of
/// blocks; [`load_matrix`] checks both before calling.
pub fn repack_q8<B: RepackQ8>(blocks: &[B], rows: usize, cols: usize) -> Q8Matrix {
    assert_eq!(
        blocks.len() * B::VALUES,
        rows * cols,
        "block count does not match the shape"
    );
    assert_eq!(
        cols % B::VALUES,
        0,
        "a row must be a whole number of blocks"
    );
    let mut scales = Vec::with_capacity(rows * cols / B::Q8_BLOCK);
    let mut quants = Vec::with_capacity(rows * cols / 4);
    for b in blocks {
        b.repack_q8(&mut scales, &mut quants);
    }
    Q8Matrix {
        rows,
        cols,
        block: B::Q8_BLOCK,
        scales,
        quants,
    }
}

/// Repacks blocks covering a `rows x cols` row-major matrix into a `Q4Matrix`.
///
/// Panics under the same conditions as [`repack_q8`].
pub fn repack_q4<B: RepackQ4>(blocks: &[B], rows: usize, cols: usize) -> Q4Matrix {
    assert_eq!(
        blocks.len() * B::VALUES,
        rows * cols,
        "block count does not match the shape"
    );
    assert_eq!(
        cols % B::VALUES,
        0,
        "a row must be a whole number of blocks"
    );
    let mut scales = Vec::with_capacity(rows * cols / 32);
    let mut mins = Vec::with_capacity(rows * cols / 32);
    let mut quants = Vec::with_capacity(rows * cols / 8);
    for b in blocks {
        b.repack_q4(&mut scales, &mut mins, &mut quants);
    }
    Q4Matrix {
        rows,
        cols,
        scales,
        mins,
        quants,
    }
}

/// Validates `bytes` against `info` and returns `(rows, cols)` as usize.
fn shape(info: &TensorInfo, bytes: &[u8]) -> Result<(usize, usize), FormatError> {
    let expected = info
        .ggml_type
        .bytes_for(info.n_elements())
        .filter(|&n| n == info.n_bytes);
    let Some(expected) = expected else {
        return Err(FormatError::TensorShape {
            tensor: info.name.clone(),
            detail: format!(
                "dims {:?} of {} do not match the recorded size of {} bytes",
                info.dims, info.ggml_type, info.n_bytes
            ),
        });
    };
    if bytes.len() as u64 != expected {
        return Err(FormatError::DataSize {
            tensor: info.name.clone(),
            expected,
            found: bytes.len() as u64,
        });
    }
    let too_big = || FormatError::TensorShape {
        tensor: info.name.clone(),
        detail: format!(
            "dims {:?} do not fit this platform's address space",
            info.dims
        ),
    };
    let rows = usize::try_from(info.rows()).map_err(|_| too_big())?;
    let cols = usize::try_from(info.cols()).map_err(|_| too_big())?;
    if !cols.is_multiple_of(info.ggml_type.block_size()) {
        return Err(FormatError::TensorShape {
            tensor: info.name.clone(),
            detail: format!(
                "ne[0] = {cols} is not a multiple of {}'s block size {}",
                info.ggml_type.name(),
                info.ggml_type.block_size()
            ),
        });
    }
    rows.checked_mul(cols).ok_or_else(too_big)?;
    Ok((rows, cols))
}

fn supported_for_f32(info: &TensorInfo) -> Result<(), FormatError> {
    if info.ggml_type.can_dequantize() {
        Ok(())
    } else {
        Err(FormatError::UnsupportedType {
            tensor: info.name.clone(),
            ggml_type: info.ggml_type,
            operation: "dequantizing to f32",
        })
    }
}

fn blocks<'a, B: Block>(info: &TensorInfo, bytes: &'a [u8]) -> Result<&'a [B], FormatError> {
    // Blocks have alignment 1, so this fails only on a length that is not a whole number of blocks.
    bytemuck::try_cast_slice(bytes).map_err(|_| FormatError::DataSize {
        tensor: info.name.clone(),
        expected: (bytes.len() / size_of::<B>() * size_of::<B>()) as u64,
        found: bytes.len() as u64,
    })
}

fn decode_floats(ggml_type: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ggml_type {
        GgmlType::F32 => float::f32_from_bytes(bytes, out),
        GgmlType::F16 => float::f16_from_bytes(bytes, out),
        GgmlType::BF16 => float::bf16_from_bytes(bytes, out),
        _ => unreachable!("decode_floats called for {ggml_type}"),
    }
}

/// Dequantizes whole blocks of a supported type; `bytes` and `out` must cover the same values.
fn dequantize_into(ggml_type: GgmlType, bytes: &[u8], out: &mut [f32]) {
    fn run<B: Block>(bytes: &[u8], out: &mut [f32]) {
        let blocks: &[B] = bytemuck::cast_slice(bytes);
        crate::blocks::dequantize_blocks(blocks, out);
    }
    match ggml_type {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => decode_floats(ggml_type, bytes, out),
        GgmlType::Q8_0 => run::<BlockQ8_0>(bytes, out),
        GgmlType::Q4_0 => run::<BlockQ4_0>(bytes, out),
        GgmlType::Q4_1 => run::<BlockQ4_1>(bytes, out),
        GgmlType::Q5_0 => run::<BlockQ5_0>(bytes, out),
        GgmlType::Q4_K => run::<BlockQ4K>(bytes, out),
        GgmlType::Q6_K => run::<BlockQ6K>(bytes, out),
        _ => unreachable!("dequantize_into called for {ggml_type}, which can_dequantize() refuses"),
    }
}
