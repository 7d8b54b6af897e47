//! TinyGPT's compute layer: the device layer, WGSL kernels with their CPU twins, and the numerics gate.
//! It knows nothing about models or file formats.

pub mod backend;
pub mod cpu;
pub mod device;
pub mod error;
pub mod gate;
pub mod gpu;
pub mod ops;
pub mod quant;
pub mod testing;

pub use backend::{Backend, DType, TMut, TRef, Tensor};
pub use device::{BackendChoice, DeviceOptions};
pub use error::{Error, Result};
/// The wgpu version the kernels are built on (for feature flags in callers).
pub use wgpu;
