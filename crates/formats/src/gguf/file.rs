//! A parsed GGUF file together with the bytes it was parsed from.
//!
//! On native targets [`GgufFile::open`] memory-maps the file, so opening a 250 MB model costs only the
//! header parse and tensor data is paged in when a tensor is converted. [`GgufFile::from_bytes`] works on
//! an owned buffer everywhere, including wasm32 where there is no file system to map.

use std::ops::Deref;
#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;

use super::metadata::Metadata;
use super::reader::{GgufHeader, TensorInfo};
use crate::error::FormatError;
use crate::tensor::{self, KernelWeights};

enum Backing {
    Owned(Vec<u8>),
    #[cfg(not(target_arch = "wasm32"))]
    Mapped(memmap2::Mmap),
}

impl Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Owned(v) => v,
            #[cfg(not(target_arch = "wasm32"))]
            Backing::Mapped(m) => m,
        }
    }
}

/// A GGUF file: its validated header and its bytes.
pub struct GgufFile {
    header: GgufHeader,
    bytes: Backing,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.header.version)
            .field("len", &self.bytes.len())
            .field("metadata_keys", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses the file at `path`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, FormatError> {
        let path = path.as_ref();
        // A directory, a named pipe or a device is refused before opening it (opening a pipe blocks
        // until someone writes to it; mapping a device fails with the OS's puzzling "No such device").
        let meta = std::fs::metadata(path).map_err(|e| FormatError::io(path, e))?;
        if !meta.is_file() {
            let what = if meta.is_dir() {
                "is a directory"
            } else {
                "is not a regular file (a named pipe, socket or device)"
            };
            return Err(FormatError::io(
                path,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{what}; give the path of a .gguf model file"),
                ),
            ));
        }
        let file = std::fs::File::open(path).map_err(|e| FormatError::io(path, e))?;
        // SAFETY: the map is read-only and private to this process. Memory-mapping is undefined behaviour
        // only if another process truncates or rewrites the file while it is mapped; model files are not
        // modified in place (our writer replaces files by rename, which leaves existing maps intact).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| FormatError::io(path, e))?;
        let header = GgufHeader::parse(&map)?;
        Ok(GgufFile {
            header,
            bytes: Backing::Mapped(map),
        })
    }

    /// Parses a complete GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, FormatError> {
        let header = GgufHeader::parse(&bytes)?;
        Ok(GgufFile {
            header,
            bytes: Backing::Owned(bytes),
        })
    }

    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    pub fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor(name)
    }

    /// The info of tensor `name`, or [`FormatError::MissingTensor`].
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo, FormatError> {
        self.tensor(name).ok_or_else(|| FormatError::MissingTensor {
            name: name.to_string(),
        })
    }

    /// The raw bytes of a tensor of this file.
    pub fn tensor_data(&self, info: &TensorInfo) -> Result<&[u8], FormatError> {
        let out_of_bounds = || FormatError::TensorOutOfBounds {
            tensor: info.name.clone(),
            start: info.data_start,
            end: info.data_start.saturating_add(info.n_bytes),
            file_len: self.bytes.len() as u64,
        };
        let start = usize::try_from(info.data_start).map_err(|_| out_of_bounds())?;
        let len = usize::try_from(info.n_bytes).map_err(|_| out_of_bounds())?;
        let end = start.checked_add(len).ok_or_else(out_of_bounds)?;
        self.bytes.get(start..end).ok_or_else(out_of_bounds)
    }

    /// Tensor `name` converted to the kernel layout it maps onto exactly (see [`crate::load_matrix`]).
    pub fn load_matrix(&self, name: &str) -> Result<KernelWeights, FormatError> {
        let info = self.tensor_info(name)?;
        tensor::load_matrix(info, self.tensor_data(info)?)
    }

    /// Tensor `name` dequantized to f32 with the reference twins (see [`crate::dequantize_tensor`]).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, FormatError> {
        let info = self.tensor_info(name)?;
        tensor::dequantize_tensor(info, self.tensor_data(info)?)
    }

    /// Row `row` of tensor `name`, dequantized into `out` (length `cols`) without touching other rows:
    /// the token-embedding lookup path.
    pub fn dequantize_row(&self, name: &str, row: u64, out: &mut [f32]) -> Result<(), FormatError> {
        let info = self.tensor_info(name)?;
        tensor::dequantize_row(info, self.tensor_data(info)?, row, out)
    }
}
