//! The kernels crate's error type: every failure a caller can cause or meet says what went wrong and,
//! where there is one, what to do.

/// Errors from the device layer and the ops.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No adapter could be opened on any backend.
    #[error(
        "no GPU adapter is available ({0}). Install a Vulkan driver (on Debian/Ubuntu: \
         `apt-get install mesa-vulkan-drivers` gives a software adapter), or run with `--backend cpu`"
    )]
    NoAdapter(String),
    /// The adapter the user asked for is not there.
    #[error("no adapter matches {query:?}; available adapters:\n{available}")]
    AdapterNotFound { query: String, available: String },
    /// The adapter refused the device request.
    #[error("adapter {adapter:?} refused the device request: {reason}")]
    RequestDevice { adapter: String, reason: String },
    /// An op was called with shapes or buffers that do not fit together.
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    /// A tensor of one backend was handed to the other backend.
    #[error("{op}: tensor lives on the {found} backend, but the op runs on the {expected} backend")]
    BackendMismatch {
        op: &'static str,
        expected: &'static str,
        found: &'static str,
    },
    /// A tensor does not fit the device's limits even after splitting.
    #[error("{0}")]
    Limits(String),
    /// A kernel failed to compile or to build its pipeline (the fast-path gates turn this into a fallback).
    #[error("kernel {name} could not be built: {msg}")]
    Pipeline { name: String, msg: String },
    /// A validation or out-of-memory error raised by the GPU driver or wgpu.
    #[error("GPU error: {0}")]
    Gpu(String),
    /// The device was lost (driver reset, GPU removed, or out of memory).
    #[error("the GPU device was lost: {0}. Re-run, or use `--backend cpu`")]
    DeviceLost(String),
}

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Builds a shape error for `op`.
pub(crate) fn shape(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Shape {
        op,
        msg: msg.into(),
    }
}
