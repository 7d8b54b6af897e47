//! The KV cache of every sequence a model decodes: per layer one tensor of `slots` sequences, each
//! `context` positions of one row `[k | v]` (2 · kv_heads · head_dim elements), so the fused Q/K/V
//! product's k and v, adjacent in its rows, move into the cache together, and one attention dispatch
//! serves the rows of every sequence of a batch. Keys are stored after their norm and RoPE, so attention
//! reads them as they are. Rolling back (a chat that regenerates a turn) only moves a sequence's
//! position: attention reads rows below it, and rows above it are overwritten before they are read again.
//!
//! ```text
//!   layer l:  | slot 0: positions 0 .. context | slot 1: ... | ... | slot slots-1 |   (row = [k | v])
//! ```

use tinygpt_kernels::{Backend, Result, Tensor};

pub(crate) struct KvPool {
    pub kv: Vec<Tensor>,
    /// Positions each sequence holds.
    pub context: usize,
    /// Elements per position: 2 · kv_heads · head_dim.
    pub width: usize,
    /// Which slots a sequence holds.
    pub taken: Vec<bool>,
}

impl KvPool {
    pub fn new(
        be: &Backend,
        layers: usize,
        slots: usize,
        context: usize,
        width: usize,
    ) -> Result<KvPool> {
        // On the CPU these are zeroed allocations the OS commits page by page as positions are written,
        // so a long context costs memory only once it is used. On the GPU a tensor split across buffers
        // splits at whole sequences, so every sequence lies in one buffer.
        let kv = (0..layers)
            .map(|_| be.zeros(slots * context * width, context * width))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvPool {
            kv,
            context,
            width,
            taken: vec![false; slots],
        })
    }

    /// The cache row of `slot`'s position 0.
    pub fn base(&self, slot: usize) -> usize {
        slot * self.context
    }

    /// Bytes one sequence's cache takes.
    pub fn slot_bytes(&self) -> u64 {
        (self.kv.len() * self.context * self.width * 4) as u64
    }

    /// Bytes allocated (on the CPU, an upper bound on what is resident).
    pub fn bytes(&self) -> u64 {
        self.kv.iter().map(Tensor::bytes).sum()
    }
}
