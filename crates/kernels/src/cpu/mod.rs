//! The CPU backend: every op's twin, run directly on host memory, multi-threaded with rayon.

/// The CPU backend. Ops run immediately on the calling thread and rayon's pool.
pub struct CpuBackend {
    pool: Option<rayon::ThreadPool>,
    threads: usize,
}

impl CpuBackend {
    /// A CPU backend using `threads` threads (None: all cores).
    pub fn new(threads: Option<usize>) -> Self {
        match threads {
            Some(n) if n > 0 => {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build().ok();
                let threads = pool
                    .as_ref()
                    .map_or_else(rayon::current_num_threads, |p| p.current_num_threads());
                Self { pool, threads }
            }
            _ => Self {
                pool: None,
                threads: rayon::current_num_threads(),
            },
        }
    }

    /// Threads the ops use.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` inside this backend's thread pool.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

/// A raw pointer into one output slice, handed to rayon workers that each write their own disjoint
/// part of it (the caller's SAFETY comment says which).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: only ever used to write disjoint elements from different workers (see each use).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    /// (A method, so closures capture the whole `SendPtr`, not its raw field.)
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}
