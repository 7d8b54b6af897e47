//! The GGUF container: reading (v2 and v3), the metadata model, and writing (v3).

pub mod file;
pub mod metadata;
pub mod reader;
pub mod value;
pub mod writer;

pub use file::GgufFile;
pub use metadata::{FromMetadata, Metadata};
pub use reader::{DEFAULT_ALIGNMENT, GgufHeader, TensorInfo};
pub use value::{MetadataArray, MetadataValue, ValueType};
pub use writer::GgufWriter;
