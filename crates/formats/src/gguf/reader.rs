//! Parsing the GGUF header: magic, version, metadata and tensor infos (versions 2 and 3).
//!
//! The layout is specified in ggml's `docs/gguf.md` and implemented by `gguf.cpp`; all integers are
//! little-endian:
//!
//! ```text
//!   "GGUF"  u32 version  u64 tensor_count  u64 kv_count
//!   kv_count x      { string key, u32 value_type, value }
//!   tensor_count x  { string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset }
//!   padding to general.alignment (default 32)
//!   tensor data; each tensor at data_start + offset, offset a multiple of the alignment
//!
//!   string = u64 length, UTF-8 bytes (no terminator)
//!   array  = u32 element_type, u64 count, count elements
//! ```
//!
//! The input is untrusted. Every read is bounds-checked and every count or length is compared with the
//! bytes that remain *before* anything is allocated for it, so a corrupt length field produces an error
//! instead of a huge allocation; all offset arithmetic is checked.

use std::collections::HashMap;
use std::ops::Range;

use super::metadata::Metadata;
use super::value::{MetadataArray, MetadataValue, ValueType};
use crate::error::FormatError;
use crate::ggml_type::GgmlType;

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are refused, so a file cannot drive the recursive reader into a
/// stack overflow (real files nest at most once, if at all).
pub const MAX_ARRAY_DEPTH: usize = 8;

/// One tensor's record from the header, validated against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml's `ne`: `dims[0]` is the fastest-varying (the number of columns of a matrix), `dims[1]` the
    /// number of rows.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the data relative to the start of the data section, as written in the file.
    pub offset: u64,
    /// Absolute offset of the data in the file.
    pub data_start: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Total number of values: the product of the dims (validated not to overflow when parsed; saturates
    /// for a hand-made info whose dims do).
    pub fn n_elements(&self) -> u64 {
        saturating_product(&self.dims)
    }

    /// `ne[0]`, the length of one row.
    pub fn cols(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Product of `ne[1..]`: the number of rows when the tensor is viewed as a matrix.
    pub fn rows(&self) -> u64 {
        saturating_product(self.dims.get(1..).unwrap_or_default())
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> u64 {
        // cols is a whole number of blocks (checked when parsed), so this cannot fail for a parsed info.
        self.ggml_type.bytes_for(self.cols()).unwrap_or(0)
    }

    /// Absolute byte range of the data in the file.
    pub fn data_range(&self) -> Range<u64> {
        self.data_start..self.data_start.saturating_add(self.n_bytes)
    }
}

fn saturating_product(dims: &[u64]) -> u64 {
    dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
}

/// Everything in a GGUF file except the tensor data itself.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufHeader {
    pub version: u32,
    /// `general.alignment`, or 32.
    pub alignment: u64,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    /// Length of the parsed buffer.
    pub file_len: u64,
    tensor_index: HashMap<String, usize>,
}

impl GgufHeader {
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Parses and validates the header of a complete GGUF file held in `bytes`. Tensor data is not read,
    /// but every tensor's data range is checked to lie inside `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<GgufHeader, FormatError> {
        let mut cur = Cursor { bytes, pos: 0 };

        let magic = cur.take(4, &|| "magic".into())?;
        if magic != GGUF_MAGIC {
            return Err(FormatError::BadMagic {
                found: magic.to_vec(),
            });
        }
        let version = cur.u32(&|| "version".into())?;
        if version != 2 && version != 3 {
            return Err(FormatError::UnsupportedVersion { version });
        }
        let tensor_count = cur.count(&|| "tensor_count".into(), MIN_TENSOR_INFO_BYTES)?;
        let kv_count = cur.count(&|| "kv_count".into(), MIN_KV_BYTES)?;

        // kv_count is bounded by the file size (see `count`), so reserving it is safe.
        let mut metadata = Metadata::with_capacity(kv_count);
        let mut alignment_at = None;
        for i in 0..kv_count {
            let key_at = cur.pos;
            let key = cur.string(&|| format!("metadata[{i}] key"))?;
            let ty = cur.value_type(&|| format!("metadata[{i}] '{key}' value type"))?;
            let value_at = cur.pos;
            let value = cur.value(ty, 0, &|| format!("metadata[{i}] '{key}' value"))?;
            if key == ALIGNMENT_KEY {
                alignment_at = Some(value_at);
            }
            if metadata.insert(key.clone(), value).is_err() {
                return Err(FormatError::DuplicateKey {
                    key,
                    offset: key_at as u64,
                });
            }
        }
        let alignment = match (metadata.get(ALIGNMENT_KEY), alignment_at) {
            (Some(value), Some(at)) => {
                let invalid = |detail: String| FormatError::Invalid {
                    what: ALIGNMENT_KEY.into(),
                    offset: at as u64,
                    detail,
                };
                match *value {
                    MetadataValue::U32(a) if a.is_power_of_two() => u64::from(a),
                    MetadataValue::U32(a) => {
                        return Err(invalid(format!(
                            "expected a non-zero power of two, found {a}"
                        )));
                    }
                    ref other => {
                        return Err(invalid(format!(
                            "expected a u32, found {}",
                            other.type_description()
                        )));
                    }
                }
            }
            _ => DEFAULT_ALIGNMENT,
        };

        let mut tensors = Vec::with_capacity(tensor_count);
        let mut tensor_index = HashMap::with_capacity(tensor_count);
        for i in 0..tensor_count {
            let name_at = cur.pos;
            let name = cur.string(&|| format!("tensor_info[{i}] name"))?;
            let info = cur.tensor_info(i, name.clone(), alignment)?;
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(FormatError::DuplicateTensor {
                    name,
                    offset: name_at as u64,
                });
            }
            tensors.push(info);
        }

        let file_len = bytes.len() as u64;
        let data_offset =
            align_up(cur.pos as u64, alignment).ok_or_else(|| FormatError::Invalid {
                what: "data section start".into(),
                offset: cur.pos as u64,
                detail: "aligning the end of the header overflows".into(),
            })?;
        for t in &mut tensors {
            let start = data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(t.n_bytes));
            match (start, end) {
                (Some(start), Some(end)) if end <= file_len => t.data_start = start,
                _ => {
                    return Err(FormatError::TensorOutOfBounds {
                        tensor: t.name.clone(),
                        start: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        file_len,
                    });
                }
            }
        }

        Ok(GgufHeader {
            version,
            alignment,
            metadata,
            tensors,
            data_offset,
            file_len,
            tensor_index,
        })
    }
}

/// Smallest possible tensor-info record: empty name (8), n_dims (4), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 4 + 8;
/// Smallest possible key/value record: empty key (8), type (4), one-byte value (1).
const MIN_KV_BYTES: usize = 8 + 4 + 1;

pub(crate) fn align_up(x: u64, alignment: u64) -> Option<u64> {
    let rem = x % alignment;
    if rem == 0 {
        Some(x)
    } else {
        x.checked_add(alignment - rem)
    }
}

/// Describes the field being read; only called to build an error message.
type What<'w> = &'w dyn Fn() -> String;

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: What) -> Result<&'a [u8], FormatError> {
        if n > self.remaining() {
            return Err(FormatError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: n as u64,
                available: self.remaining() as u64,
            });
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: What) -> Result<[u8; N], FormatError> {
        let b = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: What) -> Result<u32, FormatError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: What) -> Result<u64, FormatError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Reads a u64 count of items that each take at least `min_elem_bytes` in the file, refusing counts
    /// the rest of the file cannot hold. The result is therefore safe to allocate for.
    fn count(&mut self, what: What, min_elem_bytes: usize) -> Result<usize, FormatError> {
        let at = self.pos;
        let count = self.u64(what)?;
        let fits = count
            .checked_mul(min_elem_bytes as u64)
            .is_some_and(|bytes| bytes <= self.remaining() as u64);
        if !fits {
            return Err(FormatError::CountTooLarge {
                what: what(),
                offset: at as u64,
                count,
                min_elem_bytes: min_elem_bytes as u64,
                available: self.remaining() as u64,
            });
        }
        // count <= remaining <= usize::MAX, so the conversion is lossless.
        Ok(count as usize)
    }

    fn string(&mut self, what: What) -> Result<String, FormatError> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(FormatError::Truncated {
                what: format!("{} (string length {len})", what()),
                offset: self.pos as u64,
                needed: len,
                available: self.remaining() as u64,
            });
        }
        let bytes = self.take(len as usize, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(FormatError::Invalid {
                what: what(),
                offset: at as u64,
                detail: format!("string is not valid UTF-8 ({e})"),
            }),
        }
    }

    fn value_type(&mut self, what: What) -> Result<ValueType, FormatError> {
        let at = self.pos;
        let id = self.u32(what)?;
        ValueType::from_u32(id).ok_or_else(|| FormatError::UnknownValueType {
            what: what(),
            offset: at as u64,
            type_id: id,
        })
    }

    fn value(
        &mut self,
        ty: ValueType,
        depth: usize,
        what: What,
    ) -> Result<MetadataValue, FormatError> {
        Ok(match ty {
            ValueType::U8 => MetadataValue::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => MetadataValue::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => MetadataValue::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => MetadataValue::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => MetadataValue::U32(u32::from_le_bytes(self.array(what)?)),
            ValueType::I32 => MetadataValue::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => MetadataValue::U64(u64::from_le_bytes(self.array(what)?)),
            ValueType::I64 => MetadataValue::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F32 => MetadataValue::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::F64 => MetadataValue::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => MetadataValue::Bool(self.bool(what)?),
            ValueType::String => MetadataValue::String(self.string(what)?),
            ValueType::Array => MetadataValue::Array(self.metadata_array(depth + 1, what)?),
        })
    }

    fn bool(&mut self, what: What) -> Result<bool, FormatError> {
        let at = self.pos;
        match self.array::<1>(what)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(FormatError::Invalid {
                what: what(),
                offset: at as u64,
                detail: format!("bool must be 0 or 1, found {b}"),
            }),
        }
    }

    fn metadata_array(&mut self, depth: usize, what: What) -> Result<MetadataArray, FormatError> {
        let at = self.pos;
        if depth > MAX_ARRAY_DEPTH {
            return Err(FormatError::Invalid {
                what: what(),
                offset: at as u64,
                detail: format!("arrays nested more than {MAX_ARRAY_DEPTH} deep"),
            });
        }
        let elem = self.value_type(&|| format!("{} element type", what()))?;
        let count_what = || format!("{} element count", what());
        let n = self.count(&count_what, elem.min_encoded_size())?;

        fn fixed<'a, const N: usize, T>(
            cur: &mut Cursor<'a>,
            n: usize,
            what: What,
            from: fn([u8; N]) -> T,
        ) -> Result<Vec<T>, FormatError> {
            // n * N <= remaining was checked by `count`.
            let bytes = cur.take(n * N, what)?;
            Ok(bytes
                .chunks_exact(N)
                .map(|c| {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    from(a)
                })
                .collect())
        }

        Ok(match elem {
            ValueType::U8 => MetadataArray::U8(fixed(self, n, what, u8::from_le_bytes)?),
            ValueType::I8 => MetadataArray::I8(fixed(self, n, what, i8::from_le_bytes)?),
            ValueType::U16 => MetadataArray::U16(fixed(self, n, what, u16::from_le_bytes)?),
            ValueType::I16 => MetadataArray::I16(fixed(self, n, what, i16::from_le_bytes)?),
            ValueType::U32 => MetadataArray::U32(fixed(self, n, what, u32::from_le_bytes)?),
            ValueType::I32 => MetadataArray::I32(fixed(self, n, what, i32::from_le_bytes)?),
            ValueType::U64 => MetadataArray::U64(fixed(self, n, what, u64::from_le_bytes)?),
            ValueType::I64 => MetadataArray::I64(fixed(self, n, what, i64::from_le_bytes)?),
            ValueType::F32 => MetadataArray::F32(fixed(self, n, what, f32::from_le_bytes)?),
            ValueType::F64 => MetadataArray::F64(fixed(self, n, what, f64::from_le_bytes)?),
            ValueType::Bool => {
                let mut v = Vec::with_capacity(n);
                for j in 0..n {
                    v.push(self.bool(&|| format!("{} element {j}", what()))?);
                }
                MetadataArray::Bool(v)
            }
            ValueType::String => {
                let mut v = Vec::with_capacity(n);
                for j in 0..n {
                    v.push(self.string(&|| format!("{} element {j}", what()))?);
                }
                MetadataArray::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for j in 0..n {
                    v.push(self.metadata_array(depth + 1, &|| format!("{} element {j}", what()))?);
                }
                MetadataArray::Array(v)
            }
        })
    }

    /// Reads the rest of one tensor-info record (after its name) and validates it on its own; the data
    /// range is checked against the file once the data section's start is known.
    fn tensor_info(
        &mut self,
        i: usize,
        name: String,
        alignment: u64,
    ) -> Result<TensorInfo, FormatError> {
        let n_dims_at = self.pos;
        let n_dims = self.u32(&|| format!("tensor_info[{i}] '{name}' n_dims"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(FormatError::Invalid {
                what: format!("tensor_info[{i}] '{name}' n_dims"),
                offset: n_dims_at as u64,
                detail: format!("expected at most {MAX_DIMS} dimensions, found {n_dims}"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut n_elements: u64 = 1;
        for d in 0..n_dims {
            let what = || format!("tensor_info[{i}] '{name}' ne[{d}]");
            let at = self.pos;
            let ne = self.u64(&what)?;
            if ne == 0 {
                // ggml's own reader cannot handle empty dimensions (its overflow check divides by
                // them), so no real file has one; refusing them also keeps `cols()` bounded by the data.
                return Err(FormatError::Invalid {
                    what: what(),
                    offset: at as u64,
                    detail: "dimension is 0; every dimension must be at least 1".into(),
                });
            }
            // ggml holds ne as int64_t, and the element count must fit it too.
            let product = n_elements.checked_mul(ne).filter(|&p| p <= i64::MAX as u64);
            match product {
                Some(p) if ne <= i64::MAX as u64 => n_elements = p,
                _ => {
                    return Err(FormatError::Invalid {
                        what: what(),
                        offset: at as u64,
                        detail: format!(
                            "dimension {ne} makes the element count overflow (dims so far {dims:?})"
                        ),
                    });
                }
            }
            dims.push(ne);
        }
        let type_at = self.pos;
        let type_id = self.u32(&|| format!("tensor_info[{i}] '{name}' type"))?;
        let ggml_type =
            GgmlType::from_u32(type_id).ok_or_else(|| FormatError::UnknownTensorType {
                tensor: name.clone(),
                offset: type_at as u64,
                type_id,
            })?;
        let offset = self.u64(&|| format!("tensor_info[{i}] '{name}' offset"))?;

        let cols = dims.first().copied().unwrap_or(1);
        if !cols.is_multiple_of(ggml_type.block_size() as u64) {
            return Err(FormatError::TensorShape {
                tensor: name,
                detail: format!(
                    "ne[0] = {cols} is not a multiple of {}'s block size {}",
                    ggml_type.name(),
                    ggml_type.block_size()
                ),
            });
        }
        let n_bytes = ggml_type
            .bytes_for(n_elements)
            .ok_or_else(|| FormatError::TensorShape {
                tensor: name.clone(),
                detail: format!(
                    "byte size of {n_elements} {} values overflows",
                    ggml_type.name()
                ),
            })?;
        if !offset.is_multiple_of(alignment) {
            return Err(FormatError::MisalignedTensor {
                tensor: name,
                offset,
                alignment,
            });
        }
        Ok(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            data_start: 0,
            n_bytes,
        })
    }
}
