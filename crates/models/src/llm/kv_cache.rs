//! The KV cache: per layer, the keys and values of every position so far in one `[context, 2 · kv_heads ·
//! head_dim]` tensor, a row `[k | v]` per position (so the fused Q/K/V product's k and v, adjacent in
//! its rows, move into the cache in one copy). Keys are stored after their norm and RoPE, so attention
//! reads them as they are. Rolling back (a chat that regenerates a turn) only moves the position: the attention
//! reads rows below it, and rows above it are overwritten before they are read again.

use tinygpt_kernels::{Backend, Result, Tensor};

pub(crate) struct KvCache {
    pub kv: Vec<Tensor>,
    /// Positions each layer holds.
    pub context: usize,
}

impl KvCache {
    /// `width` elements per position: 2 · kv_heads · head_dim.
    pub fn new(be: &Backend, layers: usize, context: usize, width: usize) -> Result<KvCache> {
        // On the CPU these are zeroed allocations the OS commits page by page as positions are written,
        // so a long context costs memory only once it is used.
        let kv = (0..layers)
            .map(|_| be.zeros(context * width, width))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache { kv, context })
    }

    /// Bytes allocated (on the CPU, an upper bound on what is resident).
    pub fn bytes(&self) -> u64 {
        self.kv.iter().map(Tensor::bytes).sum()
    }
}
