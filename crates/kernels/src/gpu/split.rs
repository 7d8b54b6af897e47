//! Tensors larger than one storage binding.
//!
//! A GPU tensor is a list of chunks, each its own buffer no larger than the binding limit. Chunks split
//! at multiples of the tensor's *unit* (the row length it was allocated with), so any op that walks the
//! tensor in rows of that length (or of a divisor of it... rows that the unit is a multiple of) finds every
//! row inside one chunk.
//!
//! An op runs over `units` items of its parallel dimension (rows, tokens, batch entries); each operand
//! holds `per_unit` elements per item from its start offset. [`segments`] cuts `0..units` wherever any
//! operand crosses a chunk boundary, so that inside a segment every operand lies in one buffer and the op
//! is one dispatch per segment (one segment, in the usual case of tensors below the limit).

use crate::error::{Error, Result};

/// One buffer of a tensor: elements `start..start + len` of the whole.
#[derive(Clone, Debug)]
pub struct Chunk {
    pub buffer: wgpu::Buffer,
    pub start: usize,
    pub len: usize,
}

/// Storage of a tensor on the GPU.
#[derive(Clone, Debug)]
pub struct GpuTensor {
    pub(crate) chunks: Vec<Chunk>,
}

impl GpuTensor {
    /// The chunk holding element `i`.
    pub(crate) fn chunk_of(&self, i: usize) -> Option<usize> {
        // Chunks are in order and contiguous.
        let idx = self.chunks.partition_point(|c| c.start + c.len <= i);
        (idx < self.chunks.len()).then_some(idx)
    }

    /// Total bytes held on the device.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.buffer.size()).sum()
    }

    /// A one-chunk view of `buffer` holding `len` elements (ops use it to treat one chunk of a split
    /// tensor as a tensor of its own).
    pub(crate) fn single(buffer: wgpu::Buffer, len: usize) -> Self {
        GpuTensor {
            chunks: vec![Chunk {
                buffer,
                start: 0,
                len,
            }],
        }
    }

    /// Number of buffers the tensor is split into.
    pub fn num_chunks(&self) -> usize {
        self.chunks.len()
    }

    /// The buffer holding elements `offset..offset + len` and the offset inside it, when one buffer
    /// holds them all.
    pub(crate) fn span(&self, offset: usize, len: usize) -> Option<(&wgpu::Buffer, usize)> {
        let c = &self.chunks[self.chunk_of(offset)?];
        (offset + len <= c.start + c.len).then_some((&c.buffer, offset - c.start))
    }
}

/// How an operand takes part in a segmented op.
pub(crate) struct Operand<'a> {
    pub t: &'a GpuTensor,
    /// First element the op touches.
    pub offset: usize,
    /// Elements per unit of the op's parallel dimension; 0 for an operand every unit reads whole
    /// (a LayerNorm weight, say), which must then lie in one chunk.
    pub per_unit: usize,
    /// For `per_unit == 0`: how many elements it spans; otherwise how many of each unit's elements the
    /// op touches (0: all of them).
    pub span: usize,
}

impl<'a> Operand<'a> {
    pub fn rows(t: &'a GpuTensor, offset: usize, per_unit: usize) -> Self {
        Self {
            t,
            offset,
            per_unit,
            span: 0,
        }
    }
    /// Rows `per_unit` apart of which the op touches only the first `used` elements (a strided view:
    /// the last row may end before the tensor's next `per_unit - used` elements exist).
    pub fn strided(t: &'a GpuTensor, offset: usize, per_unit: usize, used: usize) -> Self {
        Self {
            t,
            offset,
            per_unit,
            span: used.min(per_unit),
        }
    }
    pub fn whole(t: &'a GpuTensor, offset: usize, span: usize) -> Self {
        Self {
            t,
            offset,
            per_unit: 0,
            span,
        }
    }
}

/// Where one operand lives for one segment.
#[derive(Clone, Debug)]
pub(crate) struct Place {
    pub buffer: wgpu::Buffer,
    /// Element offset of the segment's first unit inside `buffer`.
    pub offset: usize,
}

/// A range of units inside which every operand lies in one buffer.
#[derive(Clone, Debug)]
pub(crate) struct Segment {
    pub start: usize,
    pub end: usize,
    pub places: Vec<Place>,
}

impl Segment {
    pub fn len(&self) -> usize {
        self.end - self.start
    }
}

/// Cuts `0..units` into segments; see the module docs.
pub(crate) fn segments(
    op: &'static str,
    units: usize,
    operands: &[Operand<'_>],
) -> Result<Vec<Segment>> {
    let mut cuts = vec![0, units];
    for (k, o) in operands.iter().enumerate() {
        if o.per_unit == 0 {
            continue;
        }
        let end = o.offset + units * o.per_unit;
        let used = if o.span > 0 { o.span } else { o.per_unit };
        for c in &o.t.chunks {
            let b = c.start;
            if b > o.offset && b < end {
                let within = (b - o.offset) % o.per_unit;
                // A boundary in the gap after a strided row's used elements cuts before the next row.
                if within >= used {
                    cuts.push((b - o.offset) / o.per_unit + 1);
                    continue;
                }
                if within != 0 {
                    return Err(Error::Shape {
                        op,
                        msg: format!(
                            "operand {k} is split across buffers in the middle of a unit of {} elements \
                             (allocate it with a unit that is a multiple of the op's)",
                            o.per_unit
                        ),
                    });
                }
                cuts.push((b - o.offset) / o.per_unit);
            }
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::with_capacity(cuts.len().saturating_sub(1));
    for w in cuts.windows(2) {
        let (s, e) = (w[0], w[1]);
        let mut places = Vec::with_capacity(operands.len());
        for (k, o) in operands.iter().enumerate() {
            let (first, last) = if o.per_unit == 0 {
                (o.offset, o.offset + o.span.max(1) - 1)
            } else {
                let used = if o.span > 0 { o.span } else { o.per_unit };
                (
                    o.offset + s * o.per_unit,
                    o.offset + (e - 1) * o.per_unit + used - 1,
                )
            };
            let ci = o.t.chunk_of(first).ok_or_else(|| Error::Shape {
                op,
                msg: format!("operand {k}: element {first} is past the end of the tensor"),
            })?;
            let c = &o.t.chunks[ci];
            if last >= c.start + c.len {
                return Err(Error::Shape {
                    op,
                    msg: format!(
                        "operand {k}: elements {first}..={last} cross a buffer boundary or the tensor's end"
                    ),
                });
            }
            places.push(Place {
                buffer: c.buffer.clone(),
                offset: first - c.start,
            });
        }
        out.push(Segment {
            start: s,
            end: e,
            places,
        });
    }
    if units == 0 {
        out.clear();
    }
    Ok(out)
}
