//! The two backends behind one type, and the tensors they hold.
//!
//! Model code is written once against [`Backend`] and [`Tensor`]; each op module matches on the backend
//! and runs either its CPU twin or its WGSL kernel. Tensors are flat arrays of 4-byte elements (f32, or
//! u32 for token ids and packed data); ops take explicit dimensions, BLAS style, and views
//! ([`TRef`], [`TMut`]) that start at an element offset, so one tensor can hold many parameters.
//! Outputs are `&mut`, so Rust's borrow rules rule out an op reading the tensor it writes.

use crate::cpu::CpuBackend;
use crate::error::{Error, Result};
use crate::gpu::{GpuBackend, GpuTensor};

/// Element type of a tensor. Both are 4 bytes wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    U32,
}

/// Where the ops run. (One per process: boxing the larger variant would buy nothing.)
#[allow(clippy::large_enum_variant)]
pub enum Backend {
    Cpu(CpuBackend),
    Gpu(GpuBackend),
}

/// A readback started by [`Backend::read_start`].
pub struct PendingRead(Pending);

enum Pending {
    Ready(Vec<u32>),
    Gpu(crate::gpu::PendingRead),
}

/// A read started by [`Backend::read_start`] or [`Backend::read_start_many`] and detached from the
/// backend ([`Backend::read_detach`]): any thread can finish it, while the one that started it goes on
/// recording (the copy is queued behind the work before it, so it sees exactly that work's results).
pub struct DetachedRead(Detached);

enum Detached {
    Ready(Vec<u32>),
    Gpu(crate::gpu::DetachedRead),
}

impl DetachedRead {
    /// The words read (waiting for the device's copy where it has not finished).
    pub async fn finish(self) -> Result<Vec<u32>> {
        match self.0 {
            Detached::Ready(v) => Ok(v),
            Detached::Gpu(r) => r.finish().await,
        }
    }

    /// The words of views of `lens` elements (a [`Backend::read_start_many`]) as one f32 vector each.
    pub async fn finish_many_f32(self, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        split_words(self.finish().await?, lens)
    }
}

/// Words read for several views, split back into one f32 vector per view of `lens` elements.
fn split_words(words: Vec<u32>, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
    if words.len() != lens.iter().sum::<usize>() {
        return Err(Error::Shape {
            op: "read_finish_many",
            msg: format!("{} words read for views of {lens:?}", words.len()),
        });
    }
    let mut at = 0;
    Ok(lens
        .iter()
        .map(|&n| {
            let v = bytemuck::cast_slice::<u32, f32>(&words[at..at + n]).to_vec();
            at += n;
            v
        })
        .collect())
}

pub(crate) enum Store {
    Cpu(Vec<f32>),
    Gpu(GpuTensor),
}

/// A flat array of `len` elements on one backend.
pub struct Tensor {
    len: usize,
    dtype: DType,
    pub(crate) store: Store,
}

impl Tensor {
    /// An f32 tensor of the GPU storage `t` (all its chunks).
    pub(crate) fn of_gpu(t: GpuTensor) -> Tensor {
        Tensor {
            len: t.chunks.iter().map(|c| c.len).sum(),
            dtype: DType::F32,
            store: Store::Gpu(t),
        }
    }
}

/// A read-only view of a tensor from element `offset`.
#[derive(Clone, Copy)]
pub struct TRef<'a> {
    pub(crate) t: &'a Tensor,
    pub(crate) offset: usize,
}

/// A writable view of a tensor from element `offset`.
pub struct TMut<'a> {
    pub(crate) t: &'a mut Tensor,
    pub(crate) offset: usize,
}

impl<'a> From<&'a Tensor> for TRef<'a> {
    fn from(t: &'a Tensor) -> Self {
        TRef { t, offset: 0 }
    }
}

impl<'a> From<&'a mut Tensor> for TRef<'a> {
    fn from(t: &'a mut Tensor) -> Self {
        TRef { t, offset: 0 }
    }
}

impl<'a> From<&'a mut Tensor> for TMut<'a> {
    fn from(t: &'a mut Tensor) -> Self {
        TMut { t, offset: 0 }
    }
}

impl Tensor {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// A view from element `offset`.
    pub fn at(&self, offset: usize) -> TRef<'_> {
        TRef { t: self, offset }
    }
    /// A writable view from element `offset`.
    pub fn at_mut(&mut self, offset: usize) -> TMut<'_> {
        TMut { t: self, offset }
    }
    /// The GPU storage, if the tensor lives there.
    pub fn gpu(&self) -> Option<&GpuTensor> {
        match &self.store {
            Store::Gpu(g) => Some(g),
            Store::Cpu(_) => None,
        }
    }
    /// The host data, if the tensor lives on the CPU backend.
    pub fn cpu(&self) -> Option<&[f32]> {
        match &self.store {
            Store::Cpu(v) => Some(v),
            Store::Gpu(_) => None,
        }
    }
    /// Bytes held on the device (GPU) or in host memory (CPU).
    pub fn bytes(&self) -> u64 {
        match &self.store {
            Store::Cpu(v) => (v.len() * 4) as u64,
            Store::Gpu(g) => g.bytes(),
        }
    }
}

fn check_range(op: &'static str, what: &str, t: &Tensor, offset: usize, len: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= t.len => Ok(()),
        _ => Err(Error::Shape {
            op,
            msg: format!(
                "{what}: elements {offset}..{offset}+{len} are out of range of a tensor of {}",
                t.len
            ),
        }),
    }
}

impl<'a> TRef<'a> {
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// The view `k` elements further on.
    pub fn shift(&self, k: usize) -> TRef<'a> {
        TRef {
            t: self.t,
            offset: self.offset + k,
        }
    }
    pub fn tensor(&self) -> &'a Tensor {
        self.t
    }
    /// The `len` host elements of the view (CPU backend).
    pub(crate) fn cpu(&self, op: &'static str, what: &str, len: usize) -> Result<&'a [f32]> {
        check_range(op, what, self.t, self.offset, len)?;
        match &self.t.store {
            Store::Cpu(v) => Ok(&v[self.offset..self.offset + len]),
            Store::Gpu(_) => Err(Error::BackendMismatch {
                op,
                expected: "cpu",
                found: "gpu",
            }),
        }
    }
    pub(crate) fn cpu_u32(&self, op: &'static str, what: &str, len: usize) -> Result<&'a [u32]> {
        Ok(bytemuck::cast_slice(self.cpu(op, what, len)?))
    }
    /// The GPU storage, after checking that `len` elements from the offset are in range.
    pub(crate) fn gpu(&self, op: &'static str, what: &str, len: usize) -> Result<&'a GpuTensor> {
        check_range(op, what, self.t, self.offset, len)?;
        match &self.t.store {
            Store::Gpu(g) => Ok(g),
            Store::Cpu(_) => Err(Error::BackendMismatch {
                op,
                expected: "gpu",
                found: "cpu",
            }),
        }
    }
}

impl<'a> TMut<'a> {
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// The tensor viewed.
    pub fn tensor(&self) -> &Tensor {
        self.t
    }
    /// A read-only view of the same elements.
    pub fn as_ref(&self) -> TRef<'_> {
        TRef {
            t: self.t,
            offset: self.offset,
        }
    }
    /// A shorter-lived writable view `k` elements further on.
    pub fn shift(&mut self, k: usize) -> TMut<'_> {
        TMut {
            t: self.t,
            offset: self.offset + k,
        }
    }
    /// A shorter-lived writable view of the same elements.
    pub fn reborrow(&mut self) -> TMut<'_> {
        TMut {
            t: self.t,
            offset: self.offset,
        }
    }
    pub(crate) fn cpu(&mut self, op: &'static str, what: &str, len: usize) -> Result<&mut [f32]> {
        check_range(op, what, self.t, self.offset, len)?;
        let off = self.offset;
        match &mut self.t.store {
            Store::Cpu(v) => Ok(&mut v[off..off + len]),
            Store::Gpu(_) => Err(Error::BackendMismatch {
                op,
                expected: "cpu",
                found: "gpu",
            }),
        }
    }
    pub(crate) fn cpu_u32(
        &mut self,
        op: &'static str,
        what: &str,
        len: usize,
    ) -> Result<&mut [u32]> {
        Ok(bytemuck::cast_slice_mut(self.cpu(op, what, len)?))
    }
    pub(crate) fn gpu(&self, op: &'static str, what: &str, len: usize) -> Result<&GpuTensor> {
        check_range(op, what, self.t, self.offset, len)?;
        match &self.t.store {
            Store::Gpu(g) => Ok(g),
            Store::Cpu(_) => Err(Error::BackendMismatch {
                op,
                expected: "gpu",
                found: "cpu",
            }),
        }
    }
}

impl Backend {
    /// "cpu" or "gpu".
    pub fn kind(&self) -> &'static str {
        match self {
            Backend::Cpu(_) => "cpu",
            Backend::Gpu(_) => "gpu",
        }
    }

    /// One line naming the device, for status lines.
    pub fn describe(&self) -> String {
        match self {
            Backend::Cpu(c) => format!("CPU backend, {} threads", c.threads()),
            Backend::Gpu(g) => {
                let i = g.info();
                format!(
                    "{} ({}, {}){}{}",
                    i.name,
                    i.backend,
                    if i.driver_info.is_empty() {
                        &i.driver
                    } else {
                        &i.driver_info
                    },
                    if i.low_end { ", low-end profile" } else { "" },
                    if i.shader_checks {
                        ", shader runtime checks"
                    } else {
                        ""
                    }
                )
            }
        }
    }

    pub fn as_gpu(&self) -> Option<&GpuBackend> {
        match self {
            Backend::Gpu(g) => Some(g),
            Backend::Cpu(_) => None,
        }
    }

    /// `len` zeroed f32 elements, split (on the GPU, when larger than a binding) at multiples of `unit`.
    pub fn zeros(&self, len: usize, unit: usize) -> Result<Tensor> {
        self.zeros_typed(len, unit, DType::F32)
    }

    /// `len` zeroed elements of `dtype`.
    pub fn zeros_typed(&self, len: usize, unit: usize, dtype: DType) -> Result<Tensor> {
        let store = match self {
            Backend::Cpu(_) => Store::Cpu(vec![0.0; len]),
            Backend::Gpu(g) => Store::Gpu(g.alloc(len, unit)?),
        };
        Ok(Tensor { len, dtype, store })
    }

    /// A tensor of at least `len` f32 elements for an op's intermediate results, split (where it must
    /// be) at multiples of `unit`: kept per `slot` and reused on the GPU (dispatches run in recording
    /// order, so ops may share a slot), a fresh one on the CPU.
    pub(crate) fn scratch(&self, slot: &'static str, len: usize, unit: usize) -> Result<Tensor> {
        match self {
            Backend::Cpu(_) => self.zeros(len, unit),
            Backend::Gpu(g) => Ok(Tensor::of_gpu(g.scratch_split(slot, len, unit)?)),
        }
    }

    /// A tensor holding `data`, split at multiples of `unit` elements.
    pub fn from_f32(&self, data: &[f32], unit: usize) -> Result<Tensor> {
        match self {
            Backend::Cpu(_) => Ok(Tensor {
                len: data.len(),
                dtype: DType::F32,
                store: Store::Cpu(data.to_vec()),
            }),
            Backend::Gpu(g) => {
                let t = g.alloc(data.len(), unit)?;
                g.write(&t, 0, bytemuck::cast_slice(data))?;
                Ok(Tensor {
                    len: data.len(),
                    dtype: DType::F32,
                    store: Store::Gpu(t),
                })
            }
        }
    }

    /// A tensor holding `data` (token ids, packed quants).
    pub fn from_u32(&self, data: &[u32], unit: usize) -> Result<Tensor> {
        let mut t = self.from_f32(bytemuck::cast_slice(data), unit)?;
        t.dtype = DType::U32;
        Ok(t)
    }

    /// Overwrites elements of `dst` from its view's offset with `data`.
    pub fn write_f32(&self, dst: TMut<'_>, data: &[f32]) -> Result<()> {
        self.write_words(dst, bytemuck::cast_slice(data))
    }

    /// Overwrites elements of `dst` with raw 4-byte words.
    pub fn write_u32(&self, dst: TMut<'_>, data: &[u32]) -> Result<()> {
        self.write_words(dst, data)
    }

    fn write_words(&self, mut dst: TMut<'_>, data: &[u32]) -> Result<()> {
        match self {
            Backend::Cpu(_) => {
                dst.cpu_u32("write", "dst", data.len())?
                    .copy_from_slice(data);
                Ok(())
            }
            Backend::Gpu(g) => {
                let t = dst.gpu("write", "dst", data.len())?;
                g.write(t, dst.offset, data)
            }
        }
    }

    /// Reads `len` elements of a view back to the host as f32.
    pub async fn read_f32(&self, src: TRef<'_>, len: usize) -> Result<Vec<f32>> {
        Ok(bytemuck::cast_vec(self.read_u32(src, len).await?))
    }

    /// Reads `len` elements of a view back to the host as raw words.
    pub async fn read_u32(&self, src: TRef<'_>, len: usize) -> Result<Vec<u32>> {
        match self {
            Backend::Cpu(_) => Ok(src.cpu_u32("read", "src", len)?.to_vec()),
            Backend::Gpu(g) => {
                let t = src.gpu("read", "src", len)?;
                g.read(t, src.offset, len).await
            }
        }
    }

    /// Starts reading `len` words of a view back without waiting: on the GPU the copy is submitted with
    /// the work recorded so far, and [`Backend::read_finish`] waits for that work only (on the CPU the
    /// words are read at once).
    pub fn read_start(&self, src: TRef<'_>, len: usize) -> Result<PendingRead> {
        match self {
            Backend::Cpu(_) => Ok(PendingRead(Pending::Ready(
                src.cpu_u32("read", "src", len)?.to_vec(),
            ))),
            Backend::Gpu(g) => {
                let t = src.gpu("read", "src", len)?;
                Ok(PendingRead(Pending::Gpu(g.read_start(t, src.offset, len)?)))
            }
        }
    }

    /// [`Backend::read_start`] of several views at once, `(view, len)` each: one submission and one
    /// staging buffer for all of them on the GPU. [`Backend::read_finish_many_f32`] splits the words
    /// back into one vector per view.
    pub fn read_start_many(&self, srcs: &[(TRef<'_>, usize)]) -> Result<PendingRead> {
        match self {
            Backend::Cpu(_) => {
                let mut out = Vec::with_capacity(srcs.iter().map(|&(_, n)| n).sum());
                for (src, len) in srcs {
                    out.extend_from_slice(src.cpu_u32("read", "src", *len)?);
                }
                Ok(PendingRead(Pending::Ready(out)))
            }
            Backend::Gpu(g) => {
                let parts = srcs
                    .iter()
                    .map(|(src, len)| Ok((src.gpu("read", "src", *len)?, src.offset, *len)))
                    .collect::<Result<Vec<_>>>()?;
                Ok(PendingRead(Pending::Gpu(g.read_start_many(&parts)?)))
            }
        }
    }

    /// The elements of a [`Backend::read_start_many`] of views of `lens` elements, as one f32 vector
    /// per view.
    pub async fn read_finish_many_f32(
        &self,
        p: PendingRead,
        lens: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        split_words(self.read_finish(p).await?, lens)
    }

    /// Detaches a started read from this backend, for another thread to finish.
    pub fn read_detach(&self, p: PendingRead) -> Result<DetachedRead> {
        match (p.0, self) {
            (Pending::Ready(v), _) => Ok(DetachedRead(Detached::Ready(v))),
            (Pending::Gpu(r), Backend::Gpu(g)) => Ok(DetachedRead(Detached::Gpu(g.detach(r)))),
            (Pending::Gpu(_), Backend::Cpu(_)) => Err(Error::BackendMismatch {
                op: "read_detach",
                expected: "cpu",
                found: "gpu",
            }),
        }
    }

    /// The words of a [`Backend::read_start`].
    pub async fn read_finish(&self, p: PendingRead) -> Result<Vec<u32>> {
        match (p.0, self) {
            (Pending::Ready(v), _) => Ok(v),
            (Pending::Gpu(r), Backend::Gpu(g)) => g.read_finish(r).await,
            (Pending::Gpu(_), Backend::Cpu(_)) => Err(Error::BackendMismatch {
                op: "read_finish",
                expected: "cpu",
                found: "gpu",
            }),
        }
    }

    /// The elements of a [`Backend::read_start`] as f32.
    pub async fn read_finish_f32(&self, p: PendingRead) -> Result<Vec<f32>> {
        Ok(bytemuck::cast_vec(self.read_finish(p).await?))
    }

    /// Reads a whole tensor as f32, blocking (native only; the web awaits [`Backend::read_f32`]).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn to_vec(&self, t: &Tensor) -> Result<Vec<f32>> {
        pollster::block_on(self.read_f32(t.into(), t.len()))
    }

    /// Submits recorded GPU work (no-op on the CPU).
    pub fn flush(&self) -> Result<()> {
        match self {
            Backend::Cpu(_) => Ok(()),
            Backend::Gpu(g) => g.flush(),
        }
    }

    /// Submits recorded GPU work and waits for it (no-op on the CPU).
    pub fn sync(&self) -> Result<()> {
        match self {
            Backend::Cpu(_) => Ok(()),
            Backend::Gpu(g) => g.sync(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{cpu_backend, gpu_backend};

    /// Several views read at once come back as each view read alone: views of two tensors, one
    /// across a buffer boundary of a split tensor, an empty one, on the CPU and the GPU.
    #[test]
    fn several_views_read_at_once_equal_each_read_alone() {
        let mut backends = vec![cpu_backend()];
        // Chunks of 4 KiB: a tensor of 3000 floats spans three buffers.
        backends.extend(gpu_backend(Some(4096)));
        for be in &backends {
            let a: Vec<f32> = (0..3000).map(|i| i as f32 * 0.5).collect();
            let b: Vec<f32> = (0..700).map(|i| -(i as f32) - 0.25).collect();
            let ta = be.from_f32(&a, 1).unwrap();
            let tb = be.from_f32(&b, 1).unwrap();
            let views = [
                (ta.at(1000), 100),
                (tb.at(0), 700),
                (ta.at(5), 0),
                (ta.at(2990), 10),
            ];
            let lens = views.iter().map(|&(_, n)| n).collect::<Vec<_>>();
            let read = be.read_start_many(&views).unwrap();
            let got = pollster::block_on(be.read_finish_many_f32(read, &lens)).unwrap();
            assert_eq!(got.len(), views.len());
            for ((view, n), got) in views.iter().zip(&got) {
                let alone = pollster::block_on(be.read_f32(*view, *n)).unwrap();
                assert_eq!(*got, alone, "{}", be.kind());
            }
            assert_eq!(got[0], a[1000..1100]);
            assert_eq!(got[1], b);
            assert!(got[2].is_empty());
            assert_eq!(got[3], a[2990..]);
        }
    }
}
