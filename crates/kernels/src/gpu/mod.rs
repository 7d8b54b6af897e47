//! The wgpu backend: device, pipeline cache, and the recorder that puts a whole step's dispatches into
//! one compute pass and one submit.

mod pipeline;
pub(crate) mod split;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex};

pub use pipeline::Access;
pub(crate) use pipeline::Pipeline;
pub use split::GpuTensor;

pub(crate) use split::{Operand, Segment, segments};

use crate::error::{Error, Result};
use split::Chunk;

/// Capacity of the per-submit parameter buffer. Each dispatch takes one aligned slot (256 bytes on most
/// adapters), so this holds about 16k dispatches before a recording must be submitted early.
const PARAM_CAPACITY: u64 = 4 << 20;

/// Bind groups kept for reuse; beyond this the cache is dropped and rebuilt, so that bind groups of
/// freed temporaries do not keep their buffers alive for long.
const BIND_GROUP_CACHE: usize = 8192;

/// What the device reported and what we asked of it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuInfo {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub driver_info: String,
    pub vendor: u32,
    pub device: u32,
    pub features: Vec<String>,
    pub low_end: bool,
    /// Kernels compiled with naga's runtime checks ([`crate::device::DeviceOptions::shader_checks`]).
    pub shader_checks: bool,
    pub max_storage_binding: u64,
    pub max_buffer: u64,
    pub max_storage_buffers_per_stage: u32,
    pub max_workgroup_storage: u32,
    pub max_invocations_per_workgroup: u32,
    pub subgroup_min_size: u32,
    pub subgroup_max_size: u32,
    /// Cooperative-matrix shapes the adapter offers, as "MxNxK ab->cr".
    pub cooperative_matrix: Vec<String>,
}

/// Counters for the benchmark output: how many submits and dispatches a piece of work took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCounters {
    pub submits: u64,
    pub dispatches: u64,
    pub readbacks: u64,
}

/// A readback submitted by [`GpuBackend::read_start`] and not yet collected.
pub struct PendingRead {
    staging: wgpu::Buffer,
    rx: futures_channel::oneshot::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
    index: wgpu::SubmissionIndex,
    len: usize,
    /// Where the staging buffer goes back once read.
    pool: StagingPool,
}

/// Staging buffers of finished reads, kept for the next ones: a mappable buffer costs the driver an
/// allocation of host memory (measured ~2.4 ms for the ~12 MB a drift check reads, on an H100 host),
/// which a decode step's reads would otherwise pay every time. Shared with the threads that finish
/// detached reads.
#[derive(Clone, Default)]
struct StagingPool(Arc<Mutex<Vec<wgpu::Buffer>>>);

/// Most staging buffers kept, and the most bytes they may hold together.
const STAGING_KEEP: usize = 8;
const STAGING_KEEP_BYTES: u64 = 64 << 20;

impl StagingPool {
    /// The smallest kept buffer of at least `size` bytes, or a new one (rounded up to a power of two,
    /// so reads of slowly growing sizes find it again).
    fn take(&self, device: &wgpu::Device, size: u64) -> wgpu::Buffer {
        if let Ok(mut kept) = self.0.lock()
            && let Some(i) = (0..kept.len())
                .filter(|&i| kept[i].size() >= size)
                .min_by_key(|&i| kept[i].size())
        {
            return kept.swap_remove(i);
        }
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: size.next_power_of_two().max(4096),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Keeps an unmapped buffer for later reads, within the pool's bounds (the smallest go first).
    fn give(&self, b: wgpu::Buffer) {
        if let Ok(mut kept) = self.0.lock() {
            kept.push(b);
            kept.sort_by_key(|b| std::cmp::Reverse(b.size()));
            while kept.len() > STAGING_KEEP
                || kept.iter().map(wgpu::Buffer::size).sum::<u64>() > STAGING_KEEP_BYTES
            {
                kept.pop();
            }
        }
    }
}

/// A [`PendingRead`] with the device it waits on: [`DetachedRead::finish`] needs nothing else, so a
/// thread other than the one recording the device's work can wait for it and copy it out.
pub struct DetachedRead {
    read: PendingRead,
    device: wgpu::Device,
}

impl DetachedRead {
    pub(crate) async fn finish(self) -> Result<Vec<u32>> {
        finish_read(&self.device, self.read).await
    }
}

/// Waits for a read's copy (natively by polling `device`; in the browser the page drives it), maps its
/// staging buffer and copies the words out.
async fn finish_read(device: &wgpu::Device, p: PendingRead) -> Result<Vec<u32>> {
    #[cfg(not(target_arch = "wasm32"))]
    if let Err(e) = device.poll(wgpu::PollType::Wait {
        submission_index: Some(p.index),
        timeout: None,
    }) {
        // A lost device fails the wait without running its callbacks: a plain poll runs them, so
        // `GpuBackend::check` can name the loss rather than this symptom.
        let _ = device.poll(wgpu::PollType::Poll);
        return Err(Error::Gpu(format!("waiting for the device failed: {e}")));
    }
    #[cfg(target_arch = "wasm32")]
    let _ = (device, p.index);
    let mapped =
        p.rx.await
            .map_err(|_| Error::Gpu("readback was cancelled".into()))?;
    mapped.map_err(|e| Error::Gpu(format!("readback failed: {e}")))?;
    let out = {
        let view = p
            .staging
            .get_mapped_range(..(p.len.max(1) * 4) as u64)
            .map_err(|e| Error::Gpu(format!("readback failed: {e}")))?;
        let mut words = bytemuck::cast_slice::<u8, u32>(&view).to_vec();
        words.truncate(p.len);
        words
    };
    p.staging.unmap();
    p.pool.give(p.staging);
    Ok(out)
}

struct Recorder {
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    params: Vec<u8>,
    pending: u64,
}

/// A wgpu device ready to run TinyGPT's kernels.
pub struct GpuBackend {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    info: GpuInfo,
    pub(crate) features: wgpu::Features,
    pub(crate) limits: wgpu::Limits,
    /// Largest chunk in bytes (binding limit, or the test override below it).
    max_chunk_bytes: u64,
    param_align: u64,
    params_buffer: wgpu::Buffer,
    pipelines: RefCell<HashMap<String, Rc<Pipeline>>>,
    bind_groups: RefCell<HashMap<BindKey, wgpu::BindGroup>>,
    rec: RefCell<Recorder>,
    error: Arc<Mutex<Option<String>>>,
    lost: Arc<Mutex<Option<String>>>,
    counters: Cell<GpuCounters>,
    next_pipeline_id: Cell<u64>,
    scratch: RefCell<HashMap<&'static str, GpuTensor>>,
    profiler: RefCell<Option<Profiler>>,
    /// Staging buffers for reads, reused.
    staging: StagingPool,
    /// How the device was opened (by [`crate::device::open_gpu`]): a second device on the same adapter
    /// opens with these.
    opened_with: crate::device::DeviceOptions,
}

/// Timestamps around every dispatch, for `bench --profile`: what each kernel costs on the device.
struct Profiler {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    staging: wgpu::Buffer,
    /// Pipeline of each recorded dispatch of the current submit (two timestamps each).
    names: Vec<String>,
    /// Per kernel: dispatches and device nanoseconds.
    totals: HashMap<String, (u64, f64)>,
}

/// Dispatches one submit can time (two timestamps each, at most 4096 queries in a set).
const PROFILED_DISPATCHES: usize = 2048;
/// Workgroups from which a profiled dispatch is listed apart from its kernel's smaller ones.
const PROFILED_APART_GROUPS: u64 = 16_384;

/// What one kernel cost while profiling: its dispatches and their device time.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub kernel: String,
    pub dispatches: u64,
    pub micros: f64,
}

#[derive(Hash, PartialEq, Eq)]
struct BindKey {
    pipeline: u64,
    param_size: u64,
    buffers: Vec<wgpu::Buffer>,
}

fn feature_names(f: wgpu::Features) -> Vec<String> {
    let mut v = Vec::new();
    for (flag, name) in [
        (wgpu::Features::SHADER_F16, "shader-f16"),
        (wgpu::Features::SUBGROUP, "subgroup"),
        (wgpu::Features::TIMESTAMP_QUERY, "timestamp-query"),
        (
            wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
            "cooperative-matrix",
        ),
    ] {
        if f.contains(flag) {
            v.push(name.to_string());
        }
    }
    v
}

impl GpuBackend {
    pub(crate) fn new(
        device: wgpu::Device,
        queue: wgpu::Queue,
        ai: wgpu::AdapterInfo,
        limits: wgpu::Limits,
        opts: &crate::device::DeviceOptions,
        coop: Vec<wgpu::CooperativeMatrixProperties>,
    ) -> Result<Self> {
        let error = Arc::new(Mutex::new(None::<String>));
        let lost = Arc::new(Mutex::new(None::<String>));
        {
            // wgpu's default handler panics on an uncaptured error; we keep the first one and report it
            // as an Err at the next flush or read instead.
            let error = error.clone();
            device.on_uncaptured_error(Arc::new(move |e| {
                if let Ok(mut slot) = error.lock() {
                    slot.get_or_insert_with(|| e.to_string());
                }
            }));
            let lost = lost.clone();
            device.set_device_lost_callback(move |reason, msg| {
                if let Ok(mut slot) = lost.lock() {
                    slot.get_or_insert_with(|| {
                        if msg.is_empty() {
                            format!("{reason:?}")
                        } else {
                            format!("{reason:?}: {msg}")
                        }
                    });
                }
            });
        }
        let features = device.features();
        let binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        let max_chunk_bytes = opts
            .max_binding_override
            .map_or(binding, |o| o.min(binding))
            .max(256);
        let params_buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: PARAM_CAPACITY,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let info = GpuInfo {
            name: ai.name.clone(),
            backend: format!("{:?}", ai.backend),
            device_type: format!("{:?}", ai.device_type),
            driver: ai.driver.clone(),
            driver_info: ai.driver_info.clone(),
            vendor: ai.vendor,
            device: ai.device,
            features: feature_names(features),
            low_end: opts.low_end,
            shader_checks: opts.shader_checks,
            max_storage_binding: limits.max_storage_buffer_binding_size,
            max_buffer: limits.max_buffer_size,
            max_storage_buffers_per_stage: limits.max_storage_buffers_per_shader_stage,
            max_workgroup_storage: limits.max_compute_workgroup_storage_size,
            max_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
            subgroup_min_size: ai.subgroup_min_size,
            subgroup_max_size: ai.subgroup_max_size,
            cooperative_matrix: coop
                .iter()
                .map(|p| {
                    format!(
                        "{}x{}x{} {:?}->{:?}",
                        p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type
                    )
                })
                .collect(),
        };
        Ok(Self {
            param_align: u64::from(limits.min_uniform_buffer_offset_alignment).max(16),
            device,
            queue,
            info,
            features,
            limits,
            max_chunk_bytes,
            params_buffer,
            pipelines: RefCell::default(),
            bind_groups: RefCell::default(),
            rec: RefCell::new(Recorder {
                encoder: None,
                pass: None,
                params: Vec::new(),
                pending: 0,
            }),
            error,
            lost,
            counters: Cell::default(),
            next_pipeline_id: Cell::new(0),
            scratch: RefCell::default(),
            profiler: RefCell::default(),
            staging: StagingPool::default(),
            opened_with: opts.clone(),
        })
    }

    /// What the adapter is and what we asked of it.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Whether the adapter is a software one (a CPU-type adapter: lavapipe, SwiftShader, WARP), whose
    /// workgroups run as SIMD lanes of CPU threads.
    pub fn is_software(&self) -> bool {
        self.info.device_type == "Cpu"
    }

    /// The options this device was opened with ([`crate::device::open_gpu`]): another device on the
    /// same adapter, for work on a thread of its own (gating in the background), opens with them.
    pub fn opened_with(&self) -> &crate::device::DeviceOptions {
        &self.opened_with
    }

    /// Whether the device was opened with `f`.
    pub fn has_feature(&self, f: wgpu::Features) -> bool {
        self.features.contains(f)
    }

    /// Submits and dispatches so far (benchmarks print the per-step figures).
    pub fn counters(&self) -> GpuCounters {
        self.counters.get()
    }

    /// Largest number of bytes one chunk of a tensor may hold.
    pub fn max_chunk_bytes(&self) -> u64 {
        self.max_chunk_bytes
    }

    /// Destroys the device, as a driver reset or an unplugged GPU would lose it (tests of what every
    /// command does then).
    #[cfg(any(test, feature = "testing"))]
    pub fn destroy_device(&self) {
        self.device.destroy();
    }

    /// Returns the first GPU error or device loss seen since the last check.
    pub fn check(&self) -> Result<()> {
        let lost = || self.lost.lock().ok().and_then(|s| s.clone());
        if let Some(m) = lost() {
            return Err(Error::DeviceLost(m));
        }
        if let Some(m) = self.error.lock().ok().and_then(|mut s| s.take()) {
            // Work on a lost device fails validation before the loss is reported: let the device
            // deliver its callbacks, so the error names the cause rather than its symptom.
            #[cfg(not(target_arch = "wasm32"))]
            let _ = self.device.poll(wgpu::PollType::wait_indefinitely());
            if let Some(l) = lost() {
                return Err(Error::DeviceLost(l));
            }
            return Err(Error::Gpu(m));
        }
        Ok(())
    }

    // ---- tensors -------------------------------------------------------------------------------------

    /// Allocates `len` zeroed 4-byte elements, split into chunks at multiples of `unit` elements.
    pub(crate) fn alloc(&self, len: usize, unit: usize) -> Result<GpuTensor> {
        let unit = unit.max(1);
        let max_elems = (self.max_chunk_bytes / 4) as usize;
        if unit > max_elems && len > max_elems {
            return Err(Error::Limits(format!(
                "a row of {unit} elements ({}) is larger than one storage binding ({}) on this \
                 device; use a smaller batch or block size, or a device without the low-end profile",
                fmt_bytes(unit as u64 * 4),
                fmt_bytes(self.max_chunk_bytes)
            )));
        }
        let per_chunk = if len <= max_elems {
            len.max(1)
        } else {
            (max_elems / unit) * unit
        };
        let mut chunks = Vec::new();
        let mut start = 0;
        loop {
            let n = per_chunk.min(len - start).max(if len == 0 { 1 } else { 0 });
            let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: (n.max(1) * 4) as u64,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            chunks.push(Chunk {
                buffer,
                start,
                len: if len == 0 { 0 } else { n },
            });
            start += n;
            if start >= len {
                break;
            }
        }
        Ok(GpuTensor { chunks })
    }

    /// A single-buffer scratch tensor of at least `len` elements, kept per `slot` and reused by later
    /// calls. Dispatches in one pass run in recording order, so ops may share a slot freely.
    pub(crate) fn scratch(&self, slot: &'static str, len: usize) -> Result<GpuTensor> {
        if let Some(t) = self.scratch.borrow().get(slot)
            && t.chunks.len() == 1
            && t.chunks[0].len >= len
        {
            return Ok(t.clone());
        }
        if len * 4 > self.max_chunk_bytes as usize {
            return Err(Error::Limits(format!(
                "{slot}: scratch of {len} elements exceeds one storage binding"
            )));
        }
        // Grow geometrically so a slowly growing need does not reallocate every call.
        let t = self.alloc(
            len.max(1024)
                .next_power_of_two()
                .min((self.max_chunk_bytes / 4) as usize),
            1,
        )?;
        self.scratch.borrow_mut().insert(slot, t.clone());
        Ok(t)
    }

    /// A scratch tensor of at least `len` elements split (where it must be) at multiples of `unit`, kept
    /// per `slot` like [`GpuBackend::scratch`].
    pub(crate) fn scratch_split(
        &self,
        slot: &'static str,
        len: usize,
        unit: usize,
    ) -> Result<GpuTensor> {
        if len * 4 <= self.max_chunk_bytes as usize {
            return self.scratch(slot, len);
        }
        if let Some(t) = self.scratch.borrow().get(slot)
            && t.chunks.iter().map(|c| c.len).sum::<usize>() >= len
            && t.chunks
                .iter()
                .all(|c| c.len % unit.max(1) == 0 || c.start + c.len >= len)
        {
            return Ok(t.clone());
        }
        let t = self.alloc(len, unit)?;
        self.scratch.borrow_mut().insert(slot, t.clone());
        Ok(t)
    }

    /// Writes `data` (4-byte words) into `t` from element `offset`. Pending dispatches are submitted
    /// first: a queued write lands before the next submit's commands, so it must not overtake work that
    /// was recorded before it.
    pub(crate) fn write(&self, t: &GpuTensor, offset: usize, data: &[u32]) -> Result<()> {
        if self.rec.borrow().pending > 0 {
            self.flush()?;
        }
        let end = offset + data.len();
        for c in &t.chunks {
            let (s, e) = (offset.max(c.start), end.min(c.start + c.len));
            if s < e {
                self.queue.write_buffer(
                    &c.buffer,
                    ((s - c.start) * 4) as u64,
                    bytemuck::cast_slice(&data[s - offset..e - offset]),
                );
            }
        }
        Ok(())
    }

    /// Reads elements `offset..offset + len` of `t` back to the host (everything recorded before it
    /// goes with the copy, in one submission).
    pub(crate) async fn read(&self, t: &GpuTensor, offset: usize, len: usize) -> Result<Vec<u32>> {
        if len == 0 {
            self.flush()?;
            return Ok(Vec::new());
        }
        let p = self.read_start(t, offset, len)?;
        self.read_finish(p).await
    }

    /// Starts reading elements `offset..offset + len` of `t` back: the copy goes into the submission of
    /// everything recorded so far, and [`GpuBackend::read_finish`] waits for that submission only, so
    /// work recorded and submitted after this call keeps the device busy while the host waits.
    pub(crate) fn read_start(
        &self,
        t: &GpuTensor,
        offset: usize,
        len: usize,
    ) -> Result<PendingRead> {
        self.read_start_many(&[(t, offset, len)])
    }

    /// [`GpuBackend::read_start`] of several ranges `(t, offset, len)` at once, into one staging buffer
    /// with one submission (a drift check reads a range of every layer's cache: one submission and one
    /// mapping instead of one per layer); the words come back one range after the other.
    pub(crate) fn read_start_many(
        &self,
        parts: &[(&GpuTensor, usize, usize)],
    ) -> Result<PendingRead> {
        let len: usize = parts.iter().map(|&(_, _, n)| n).sum();
        let size = (len.max(1) * 4) as u64;
        let staging = self.staging.take(&self.device, size);
        let mut rec = self.rec.borrow_mut();
        drop(rec.pass.take());
        let enc = rec.encoder.take().unwrap_or_else(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor::default())
        });
        let index = self.submit(&mut rec, enc, |enc| {
            let mut at = 0;
            for &(t, offset, len) in parts {
                let end = offset + len;
                for c in &t.chunks {
                    let (s, e) = (offset.max(c.start), end.min(c.start + c.len));
                    if s < e {
                        enc.copy_buffer_to_buffer(
                            &c.buffer,
                            ((s - c.start) * 4) as u64,
                            &staging,
                            ((at + s - offset) * 4) as u64,
                            ((e - s) * 4) as u64,
                        );
                    }
                }
                at += len;
            }
        });
        drop(rec);
        self.collect_profile()?;
        let (tx, rx) = futures_channel::oneshot::channel();
        staging.map_async(wgpu::MapMode::Read, ..size, move |r| {
            let _ = tx.send(r);
        });
        let mut c = self.counters.get();
        c.readbacks += 1;
        self.counters.set(c);
        self.check()?;
        Ok(PendingRead {
            staging,
            rx,
            index,
            len,
            pool: self.staging.clone(),
        })
    }

    /// The words of a [`GpuBackend::read_start`], once its submission has finished.
    pub(crate) async fn read_finish(&self, p: PendingRead) -> Result<Vec<u32>> {
        let out = finish_read(&self.device, p).await;
        self.check()?;
        out
    }

    /// A started read that another thread can finish (it holds what it needs of the device).
    pub(crate) fn detach(&self, p: PendingRead) -> DetachedRead {
        DetachedRead {
            read: p,
            device: self.device.clone(),
        }
    }

    /// Blocks until the device has finished all submitted work (native); on the web the browser drives
    /// completion, so this only checks for errors.
    pub fn wait(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Gpu(format!("waiting for the device failed: {e}")))?;
        self.check()
    }

    /// Submits everything recorded so far and waits for it (benchmarks time with this).
    pub fn sync(&self) -> Result<()> {
        self.flush()?;
        self.wait()
    }

    // ---- recording ------------------------------------------------------------------------------------

    /// Ends the current compute pass and submits the recording, if anything was recorded.
    pub fn flush(&self) -> Result<()> {
        let mut rec = self.rec.borrow_mut();
        drop(rec.pass.take());
        if let Some(enc) = rec.encoder.take() {
            self.submit(&mut rec, enc, |_| {});
        }
        drop(rec);
        self.collect_profile()?;
        self.check()
    }

    /// Submits `enc` with the recording's parameter block, after `extra` adds its last commands.
    fn submit(
        &self,
        rec: &mut Recorder,
        mut enc: wgpu::CommandEncoder,
        extra: impl FnOnce(&mut wgpu::CommandEncoder),
    ) -> wgpu::SubmissionIndex {
        extra(&mut enc);
        if let Some(p) = self.profiler.borrow().as_ref()
            && !p.names.is_empty()
        {
            let n = 2 * p.names.len() as u32;
            enc.resolve_query_set(&p.set, 0..n, &p.resolve, 0);
            enc.copy_buffer_to_buffer(&p.resolve, 0, &p.staging, 0, u64::from(n) * 8);
        }
        if !rec.params.is_empty() {
            self.queue.write_buffer(&self.params_buffer, 0, &rec.params);
        }
        let index = self.queue.submit([enc.finish()]);
        rec.params.clear();
        rec.pending = 0;
        let mut c = self.counters.get();
        c.submits += 1;
        self.counters.set(c);
        index
    }

    /// Starts timing every dispatch on the device (needs TIMESTAMP_QUERY_INSIDE_PASSES): each submit then
    /// waits for the device and adds its dispatches' times to [`GpuBackend::profile`]. Off by default:
    /// it costs a round trip per submit.
    pub fn start_profiling(&self) -> Result<()> {
        if !self
            .features
            .contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES)
        {
            return Err(Error::Gpu(
                "this adapter cannot time dispatches (no timestamp queries inside passes)".into(),
            ));
        }
        self.flush()?;
        let n = 2 * PROFILED_DISPATCHES as u64;
        let buffer = |usage, label| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: n * 8,
                usage,
                mapped_at_creation: false,
            })
        };
        *self.profiler.borrow_mut() = Some(Profiler {
            set: self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: n as u32,
            }),
            resolve: buffer(
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                "profile resolve",
            ),
            staging: buffer(
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                "profile staging",
            ),
            names: Vec::new(),
            totals: HashMap::new(),
        });
        Ok(())
    }

    /// Stops timing; returns each kernel's dispatches and device time since [`GpuBackend::start_profiling`],
    /// the costliest first.
    pub fn profile(&self) -> Result<Vec<KernelTime>> {
        self.flush()?;
        let Some(p) = self.profiler.borrow_mut().take() else {
            return Ok(Vec::new());
        };
        let mut v: Vec<KernelTime> = p
            .totals
            .into_iter()
            .map(|(kernel, (dispatches, ns))| KernelTime {
                kernel,
                dispatches,
                micros: ns / 1e3,
            })
            .collect();
        v.sort_by(|a, b| b.micros.total_cmp(&a.micros));
        Ok(v)
    }

    /// Reads the timestamps of the last submit (waiting for it) into the profile's totals.
    fn collect_profile(&self) -> Result<()> {
        let mut guard = self.profiler.borrow_mut();
        let Some(p) = guard.as_mut() else {
            return Ok(());
        };
        if p.names.is_empty() {
            return Ok(());
        }
        let n = 2 * p.names.len();
        let (tx, rx) = std::sync::mpsc::channel();
        p.staging
            .slice(..(n * 8) as u64)
            .map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Gpu(format!("waiting for the device failed: {e}")))?;
        rx.recv()
            .map_err(|_| Error::Gpu("profile readback was cancelled".into()))?
            .map_err(|e| Error::Gpu(format!("profile readback failed: {e}")))?;
        let ticks: Vec<u64> = {
            let view = p
                .staging
                .slice(..(n * 8) as u64)
                .get_mapped_range()
                .map_err(|e| Error::Gpu(format!("profile readback failed: {e}")))?;
            bytemuck::cast_slice::<u8, u64>(&view).to_vec()
        };
        p.staging.unmap();
        let period = f64::from(self.queue.get_timestamp_period());
        for (i, name) in p.names.drain(..).enumerate() {
            let ns = ticks[2 * i + 1].saturating_sub(ticks[2 * i]) as f64 * period;
            let e = p.totals.entry(name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += ns;
        }
        Ok(())
    }

    /// Records one dispatch of `pipe` with `params` (the kernel's uniform block) and `buffers` (its storage
    /// bindings 1..) into the current compute pass.
    pub(crate) fn dispatch(
        &self,
        pipe: &Pipeline,
        params: &[u32],
        buffers: &[&wgpu::Buffer],
        groups: [u32; 3],
    ) -> Result<()> {
        if groups.contains(&0) {
            return Ok(());
        }
        let max = self.limits.max_compute_workgroups_per_dimension;
        if groups.iter().any(|&g| g > max) {
            return Err(Error::Limits(format!(
                "{}: dispatch of {groups:?} workgroups exceeds the device's {max} per dimension",
                pipe.name
            )));
        }
        if buffers.len() != pipe.storage {
            return Err(Error::Shape {
                op: "dispatch",
                msg: format!(
                    "{} takes {} storage buffers, got {}",
                    pipe.name,
                    pipe.storage,
                    buffers.len()
                ),
            });
        }
        // A buffer written through one binding may not be bound again in the same dispatch (WebGPU
        // rejects it when it records the pass, native wgpu does not): an error here, on every backend.
        for (i, a) in buffers.iter().enumerate() {
            for (j, b) in buffers.iter().enumerate().skip(i + 1) {
                if a == b && (pipe.writable[i] || pipe.writable[j]) {
                    return Err(Error::Shape {
                        op: "dispatch",
                        msg: format!(
                            "{} binds one buffer at storage bindings {i} and {j}, one of them written",
                            pipe.name
                        ),
                    });
                }
            }
        }
        // Uniform blocks are 16-byte multiples.
        let size = ((params.len() * 4).max(16) as u64).div_ceil(16) * 16;
        let mut rec = self.rec.borrow_mut();
        let mut slot = (rec.params.len() as u64).div_ceil(self.param_align) * self.param_align;
        if slot + size > PARAM_CAPACITY {
            drop(rec);
            self.flush()?;
            rec = self.rec.borrow_mut();
            slot = 0;
        }
        rec.params.resize(slot as usize, 0);
        rec.params.extend_from_slice(bytemuck::cast_slice(params));
        rec.params.resize((slot + size) as usize, 0);

        let key = BindKey {
            pipeline: pipe.id,
            param_size: size,
            buffers: buffers.iter().map(|b| (*b).clone()).collect(),
        };
        let mut cache = self.bind_groups.borrow_mut();
        if cache.len() >= BIND_GROUP_CACHE {
            cache.clear();
        }
        let bind_group = cache.entry(key).or_insert_with(|| {
            let mut entries = Vec::with_capacity(buffers.len() + 1);
            entries.push(wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.params_buffer,
                    offset: 0,
                    size: wgpu::BufferSize::new(size),
                }),
            });
            for (i, b) in buffers.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: b.as_entire_binding(),
                });
            }
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &pipe.layout,
                entries: &entries,
            })
        });

        if rec.encoder.is_none() {
            rec.encoder = Some(
                self.device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor::default()),
            );
        }
        if rec.pass.is_none() {
            let enc = rec.encoder.as_mut().expect("encoder was just created");
            let pass = enc
                .begin_compute_pass(&wgpu::ComputePassDescriptor::default())
                .forget_lifetime();
            rec.pass = Some(pass);
        }
        let pass = rec.pass.as_mut().expect("pass was just created");
        pass.set_pipeline(&pipe.pipeline);
        pass.set_bind_group(0, &*bind_group, &[slot as u32]);
        let mut prof = self.profiler.borrow_mut();
        let timed = match prof.as_mut() {
            Some(p) if p.names.len() < PROFILED_DISPATCHES => {
                let i = 2 * p.names.len() as u32;
                // A dispatch far larger than a kernel's usual ones (a model's head among its
                // layers' products) is listed apart, under its size.
                let n: u64 = groups.iter().map(|&g| u64::from(g)).product();
                p.names.push(if n >= PROFILED_APART_GROUPS {
                    format!("{} ({n} workgroups)", pipe.name)
                } else {
                    pipe.name.clone()
                });
                pass.write_timestamp(&p.set, i);
                Some((i, &p.set))
            }
            _ => None,
        };
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        if let Some((i, set)) = timed {
            pass.write_timestamp(set, i + 1);
        }
        drop(prof);
        rec.pending += 1;
        let mut c = self.counters.get();
        c.dispatches += 1;
        self.counters.set(c);
        Ok(())
    }

    /// Workgroup grid covering `n` groups in one dimension, folded into y past the per-dimension limit.
    /// Kernels rebuild the flat index as `wid.x + wid.y * nwg.x`.
    pub(crate) fn grid(&self, n: usize) -> [u32; 3] {
        let max = self.limits.max_compute_workgroups_per_dimension as usize;
        if n <= max {
            [n as u32, 1, 1]
        } else {
            [max as u32, n.div_ceil(max) as u32, 1]
        }
    }

    /// The pipeline for `key`, built from `source()` on first use.
    pub(crate) fn pipeline(
        &self,
        key: &str,
        bindings: &[Access],
        source: impl FnOnce() -> String,
    ) -> Result<Rc<Pipeline>> {
        if let Some(p) = self.pipelines.borrow().get(key) {
            return Ok(p.clone());
        }
        let id = self.next_pipeline_id.get();
        self.next_pipeline_id.set(id + 1);
        let p = Rc::new(pipeline::build(
            &self.device,
            key,
            id,
            bindings,
            self.info.shader_checks,
            &source(),
        )?);
        self.pipelines
            .borrow_mut()
            .insert(key.to_string(), p.clone());
        Ok(p)
    }
}

/// Bytes for people: "512 B", "4.0 KiB", "128.0 MiB", "2.0 GiB".
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}
