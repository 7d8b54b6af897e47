//! Writing GGUF version 3 files.
//!
//! Metadata is written in insertion order, tensors in insertion order with each tensor's data padded to
//! the alignment (as ggml's own writer does), so offsets are predictable. [`GgufWriter::write_atomic`]
//! writes to a temporary file in the destination directory and renames it into place, so a crash or a
//! full disk never leaves a partial file under the final name.

use std::collections::HashSet;
use std::io::Write;
#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;

use super::metadata::Metadata;
use super::reader::{
    ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS, align_up,
};
use super::value::{MetadataArray, MetadataValue};
use crate::error::FormatError;
use crate::ggml_type::GgmlType;
use crate::tensor::quantize;

/// The version this writer produces.
pub const GGUF_WRITE_VERSION: u32 = 3;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF file in memory and writes it out.
pub struct GgufWriter {
    metadata: Metadata,
    alignment: u64,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            metadata: Metadata::new(),
            alignment: DEFAULT_ALIGNMENT,
            tensors: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// Sets the tensor data alignment (a power of two) and records it as `general.alignment`.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<(), FormatError> {
        if !alignment.is_power_of_two() {
            return Err(FormatError::Write {
                detail: format!("alignment must be a non-zero power of two, got {alignment}"),
            });
        }
        self.alignment = u64::from(alignment);
        self.metadata.set(ALIGNMENT_KEY, alignment);
        Ok(())
    }

    /// Adds a metadata entry. Keys must be unique; `general.alignment` must be a u32 power of two and
    /// also sets the alignment used for the tensor data.
    pub fn add_metadata(
        &mut self,
        key: impl Into<String>,
        value: impl Into<MetadataValue>,
    ) -> Result<(), FormatError> {
        let key = key.into();
        let value = value.into();
        if key == ALIGNMENT_KEY {
            match value {
                MetadataValue::U32(a) if !self.metadata.contains_key(ALIGNMENT_KEY) => {
                    return self.set_alignment(a);
                }
                MetadataValue::U32(_) => {}
                ref other => {
                    return Err(FormatError::Write {
                        detail: format!(
                            "{ALIGNMENT_KEY} must be a u32, got {}",
                            other.type_description()
                        ),
                    });
                }
            }
        }
        if let MetadataValue::Array(a) = &value
            && array_depth(a) > MAX_ARRAY_DEPTH
        {
            return Err(FormatError::Write {
                detail: format!(
                    "metadata '{key}': arrays nested more than {MAX_ARRAY_DEPTH} deep cannot be read back"
                ),
            });
        }
        self.metadata
            .insert(key.clone(), value)
            .map_err(|_| FormatError::Write {
                detail: format!("duplicate metadata key '{key}'"),
            })
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Adds a tensor from its already-encoded bytes. `dims` is ggml's `ne` (cols first).
    pub fn add_tensor_bytes(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        data: Vec<u8>,
    ) -> Result<(), FormatError> {
        let name = name.into();
        let err = |detail: String| FormatError::Write {
            detail: format!("tensor '{name}': {detail}"),
        };
        if dims.len() > MAX_DIMS {
            return Err(err(format!(
                "{} dimensions, at most {MAX_DIMS} allowed",
                dims.len()
            )));
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| err(format!("element count of dims {dims:?} overflows")))?;
        let cols = dims.first().copied().unwrap_or(1);
        if !cols.is_multiple_of(ggml_type.block_size() as u64) {
            return Err(err(format!(
                "ne[0] = {cols} is not a multiple of {}'s block size {}",
                ggml_type.name(),
                ggml_type.block_size()
            )));
        }
        let expected = ggml_type
            .bytes_for(n_elements)
            .ok_or_else(|| err("byte size overflows".into()))?;
        if data.len() as u64 != expected {
            return Err(err(format!(
                "{} data must be {expected} bytes for dims {dims:?}, got {}",
                ggml_type.name(),
                data.len()
            )));
        }
        if !self.names.insert(name.clone()) {
            return Err(err("duplicate tensor name".into()));
        }
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ggml_type,
            data,
        });
        Ok(())
    }

    /// Adds a tensor given as row-major f32 values, encoded as `ggml_type` with [`quantize`].
    pub fn add_tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        values: &[f32],
    ) -> Result<(), FormatError> {
        let data = quantize(ggml_type, values)?;
        self.add_tensor_bytes(name, dims, ggml_type, data)
    }

    /// Offsets (relative to the data section) that the tensors will get, in insertion order.
    fn tensor_offsets(&self) -> Result<Vec<u64>, FormatError> {
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut next = 0u64;
        for t in &self.tensors {
            offsets.push(next);
            next = next
                .checked_add(t.data.len() as u64)
                .and_then(|end| align_up(end, self.alignment))
                .ok_or_else(|| FormatError::Write {
                    detail: "tensor data size overflows".into(),
                })?;
        }
        Ok(offsets)
    }

    /// Writes the complete file to `out`; returns the number of bytes written.
    pub fn write_to(&self, out: &mut impl Write) -> Result<u64, FormatError> {
        let mut w = Counting {
            inner: out,
            written: 0,
        };
        self.write_inner(&mut w)
            .map_err(|e| FormatError::io("<GGUF output stream>", e))?;
        Ok(w.written)
    }

    /// The complete file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, FormatError> {
        let mut out = Vec::new();
        self.write_to(&mut out)?;
        Ok(out)
    }

    fn write_inner(&self, w: &mut Counting<impl Write>) -> std::io::Result<()> {
        let offsets = self
            .tensor_offsets()
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        w.write_all(&GGUF_MAGIC)?;
        w.write_all(&GGUF_WRITE_VERSION.to_le_bytes())?;
        w.write_all(&(self.tensors.len() as u64).to_le_bytes())?;
        w.write_all(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in self.metadata.iter() {
            write_string(w, key)?;
            w.write_all(&(value.value_type() as u32).to_le_bytes())?;
            write_value(w, value)?;
        }
        for (t, offset) in self.tensors.iter().zip(&offsets) {
            write_string(w, &t.name)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                w.write_all(&d.to_le_bytes())?;
            }
            w.write_all(&(t.ggml_type as u32).to_le_bytes())?;
            w.write_all(&offset.to_le_bytes())?;
        }
        w.pad_to(self.alignment)?;
        for t in &self.tensors {
            w.write_all(&t.data)?;
            w.pad_to(self.alignment)?;
        }
        Ok(())
    }

    /// Writes the file to `path` atomically: into a temporary file in the same directory, flushed to
    /// disk, then renamed over `path`. On error the temporary file is removed and `path` is untouched.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn write_atomic(&self, path: impl AsRef<Path>) -> Result<(), FormatError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);

        let path = path.as_ref();
        let file_name = path.file_name().ok_or_else(|| FormatError::Write {
            detail: format!("{} has no file name", path.display()),
        })?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let tmp = dir.join(format!(
            ".{}.tmp-{}-{}",
            file_name.to_string_lossy(),
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let result = (|| -> Result<(), FormatError> {
            let file = std::fs::File::create_new(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
            let mut buffered = std::io::BufWriter::with_capacity(1 << 20, file);
            let mut w = Counting {
                inner: &mut buffered,
                written: 0,
            };
            self.write_inner(&mut w)
                .map_err(|e| FormatError::io(&tmp, e))?;
            let file = buffered
                .into_inner()
                .map_err(|e| FormatError::io(&tmp, e.into_error()))?;
            file.sync_all().map_err(|e| FormatError::io(&tmp, e))?;
            drop(file);
            std::fs::rename(&tmp, path).map_err(|e| FormatError::io(path, e))?;
            // Make the rename itself durable. Directories cannot be opened for syncing everywhere, so
            // this is best effort.
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

/// A writer that counts bytes so padding can be computed without seeking.
struct Counting<W> {
    inner: W,
    written: u64,
}

impl<W: Write> Counting<W> {
    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.inner.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, alignment: u64) -> std::io::Result<()> {
        let target = align_up(self.written, alignment)
            .ok_or_else(|| std::io::Error::other("padding overflows"))?;
        const ZEROS: [u8; 64] = [0; 64];
        while self.written < target {
            let n = ((target - self.written) as usize).min(ZEROS.len());
            self.write_all(&ZEROS[..n])?;
        }
        Ok(())
    }
}

/// Levels of array nesting: 1 for an array of scalars.
fn array_depth(a: &MetadataArray) -> usize {
    match a {
        MetadataArray::Array(v) => 1 + v.iter().map(array_depth).max().unwrap_or(0),
        _ => 1,
    }
}

fn write_string(w: &mut Counting<impl Write>, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value(w: &mut Counting<impl Write>, value: &MetadataValue) -> std::io::Result<()> {
    match value {
        MetadataValue::U8(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::I8(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::U16(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::I16(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::U32(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::I32(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::U64(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::I64(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::F32(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::F64(v) => w.write_all(&v.to_le_bytes()),
        MetadataValue::Bool(v) => w.write_all(&[u8::from(*v)]),
        MetadataValue::String(s) => write_string(w, s),
        MetadataValue::Array(a) => write_array(w, a),
    }
}

fn write_array(w: &mut Counting<impl Write>, a: &MetadataArray) -> std::io::Result<()> {
    w.write_all(&(a.element_type() as u32).to_le_bytes())?;
    w.write_all(&(a.len() as u64).to_le_bytes())?;
    macro_rules! each {
        ($v:expr) => {{
            for x in $v {
                w.write_all(&x.to_le_bytes())?;
            }
            Ok(())
        }};
    }
    match a {
        MetadataArray::U8(v) => w.write_all(v),
        MetadataArray::I8(v) => each!(v),
        MetadataArray::U16(v) => each!(v),
        MetadataArray::I16(v) => each!(v),
        MetadataArray::U32(v) => each!(v),
        MetadataArray::I32(v) => each!(v),
        MetadataArray::U64(v) => each!(v),
        MetadataArray::I64(v) => each!(v),
        MetadataArray::F32(v) => each!(v),
        MetadataArray::F64(v) => each!(v),
        MetadataArray::Bool(v) => {
            for &b in v {
                w.write_all(&[u8::from(b)])?;
            }
            Ok(())
        }
        MetadataArray::String(v) => {
            for s in v {
                write_string(w, s)?;
            }
            Ok(())
        }
        MetadataArray::Array(v) => {
            for inner in v {
                write_array(w, inner)?;
            }
            Ok(())
        }
    }
}
