//! The KV cache: per layer, the keys and the values of every position so far, each a
//! `[context, kv_heads · head_dim]` tensor. Keys are stored after their norm and RoPE, so attention reads
//! them as they are. Rolling back (a chat that regenerates a turn) only moves the position: the attention
//! reads rows below it, and rows above it are overwritten before they are read again.

use tinygpt_kernels::{Backend, Result, Tensor};

pub(crate) struct KvCache {
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Positions each layer holds.
    pub context: usize,
}

impl KvCache {
    pub fn new(be: &Backend, layers: usize, context: usize, width: usize) -> Result<KvCache> {
        // On the CPU these are zeroed allocations the OS commits page by page as positions are written,
        // so a long context costs memory only once it is used.
        let mk = || {
            (0..layers)
                .map(|_| be.zeros(context * width, width))
                .collect::<Result<Vec<_>>>()
        };
        Ok(KvCache {
            k: mk()?,
            v: mk()?,
            context,
        })
    }

    /// Bytes allocated (on the CPU, an upper bound on what is resident).
    pub fn bytes(&self) -> u64 {
        self.k.iter().chain(&self.v).map(Tensor::bytes).sum()
    }
}
