//! TinyGPT's compute layer: the device layer, WGSL kernels with their CPU twins, and the numerics gate.
//! It knows nothing about models or file formats. Dependencies point one way (docs/architecture.md):
//!
//! ```text
//!   device (opening an adapter)
//!     └ gate (metric, registry of fast paths, op and token gates, verdict store)
//!         └ ops (each op: WGSL + dispatch + CPU twin)
//!             └ backend (Backend, Tensor) ── cpu, gpu (the wgpu device layer)
//!                 └ leaves: path (PathId, PathSet), rng, quant (block layouts), error
//! ```

pub mod backend;
pub mod cpu;
pub mod device;
pub mod error;
pub mod gate;
pub mod gpu;
pub mod ops;
pub mod path;
pub mod quant;
pub mod rng;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use backend::{Backend, DType, DetachedRead, PendingRead, TMut, TRef, Tensor};
pub use device::{BackendChoice, DeviceOptions};
pub use error::{Error, Result};
pub use path::{PathId, PathSet};
/// The wgpu version the kernels are built on (for feature flags in callers).
pub use wgpu;
