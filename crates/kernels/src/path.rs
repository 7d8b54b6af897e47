//! Fast-path identities and the explicit set of paths a runner uses (a leaf: it imports nothing).
//!
//! Which kernels run is a value, never ambient state: the numerics gate ([`crate::gate`]) produces a
//! [`PathSet`], a model runner or trainer holds it, and every op that has a choice of kernel receives it
//! as an argument. A runner built with a set uses exactly those kernels, whatever ran before it.

/// A fast path's identity. Its name, pill, detection and gate live in [`crate::gate::registry`].
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum PathId {
    /// Weights stored as f16 pairs, read by the f32-accumulating GEMM/GEMV variants.
    F16Storage,
    /// f16 operands in those kernels (`enable f16`), still accumulating in f32.
    ShaderF16,
    /// Subgroup reductions in the decode (GEMV) kernels.
    Subgroups,
    /// Tensor-core products through cooperative matrices.
    CoopMatrix,
    /// Products straight from block-quantized weights (else they are held dequantized).
    QuantMatmul,
    /// Training's products with f16 operands and f32 accumulation, on the tensor cores (loss-scaled
    /// gradients, f32 master weights). Only a trainer holds it; it passes a training gate first.
    MixedTraining,
    /// The CPU backend's quantized products with 15-bit integer activations and integer dot products
    /// (AVX-512 VNNI), on weights repacked at load.
    IntDot,
    /// Prompts' quantized products (32 rows and more) on the tensor cores: x and the dequantized
    /// weights rounded to f16 in workgroup memory, f32 accumulation.
    CoopQuant,
}

impl PathId {
    /// Every path, in the order they are gated and shown.
    pub const ALL: [PathId; 8] = [
        PathId::F16Storage,
        PathId::ShaderF16,
        PathId::Subgroups,
        PathId::CoopMatrix,
        PathId::QuantMatmul,
        PathId::CoopQuant,
        PathId::MixedTraining,
        PathId::IntDot,
    ];

    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

/// A deliberately broken kernel variant, which tests plant (through [`PathSet::with_fault`], behind the
/// `testing` feature) to prove the numerics gate rejects each kind of fault. Production builds can name
/// the variants but never run one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Fault {
    /// int8 quants unpacked without sign extension (quantized matmul).
    SignExtensionDropped,
    /// Products accumulated in f16 instead of f32 (f16-storage and shader-f16 kernels).
    F16Accumulation,
    /// Scale index wraps after 64 blocks: wrong only when K >= 2048 (quantized matmul).
    BlockIndexAtK2048,
    /// One element written past the end of the output (every gated matmul kernel).
    OutOfBoundsWrite,
    /// A NaN written into the output (every gated matmul kernel).
    NanOutput,
    /// RoPE rotations scaled from position 500 on, by 1 + (p − 499)/4 at position p (a GGUF model's
    /// tables): an error that grows with the position, right for every
    /// position the start-up gates reach, wrong only in long generations — what the drift guard is
    /// for. No op gate can see it (it is not in [`Fault::ALL`]).
    RopePast500,
    /// A char-level GPT's learned position embeddings scaled from position 200 on, by 1 + (p − 199)/4
    /// at position p: the same kind of error for a model without RoPE (drift guard; not in
    /// [`Fault::ALL`]).
    PositionsPast200,
    /// Weight gradients (Aᵀ·B products) accumulated in f16 by the training path's kernels: what the
    /// training gate must reject (not in [`Fault::ALL`]: it lives in training only).
    WeightGradF16Accumulation,
    /// Activations rounded to 8 bits instead of 15 in the integer-dot kernels (CPU `int-dot` path):
    /// llama.cpp's precision, which the gate must reject.
    EightBitActivations,
    /// The causal mask of training's attention lets query positions from 128 on see one position
    /// ahead: right for short sequences, wrong past 128 (training gate; not in [`Fault::ALL`]).
    CausalMaskPast128,
}

impl Fault {
    pub const ALL: [Fault; 5] = [
        Fault::SignExtensionDropped,
        Fault::F16Accumulation,
        Fault::BlockIndexAtK2048,
        Fault::OutOfBoundsWrite,
        Fault::NanOutput,
    ];
}

/// The fast paths a runner may use; empty is the canonical f32 path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PathSet {
    bits: u32,
    #[cfg(any(test, feature = "testing"))]
    fault: Option<Fault>,
}

impl PathSet {
    /// The canonical f32 kernels only.
    pub const F32: PathSet = PathSet {
        bits: 0,
        #[cfg(any(test, feature = "testing"))]
        fault: None,
    };

    /// Exactly `paths`.
    pub fn of(paths: &[PathId]) -> Self {
        paths.iter().fold(Self::F32, |s, &p| s.with(p))
    }

    pub fn has(self, p: PathId) -> bool {
        self.bits & p.bit() != 0
    }

    pub fn with(mut self, p: PathId) -> Self {
        self.bits |= p.bit();
        self
    }

    pub fn without(mut self, p: PathId) -> Self {
        self.bits &= !p.bit();
        self
    }

    /// Paths in both sets (a planted fault of `self` is kept).
    pub fn intersect(mut self, other: PathSet) -> Self {
        self.bits &= other.bits;
        self
    }

    pub fn is_empty(self) -> bool {
        self.bits == 0
    }

    pub fn len(self) -> usize {
        self.bits.count_ones() as usize
    }

    /// The paths of the set, in [`PathId::ALL`] order.
    pub fn iter(self) -> impl Iterator<Item = PathId> {
        PathId::ALL.into_iter().filter(move |p| self.has(*p))
    }

    /// The broken variant the kernels of this set build instead of the healthy one (tests only; always
    /// `None` in production builds).
    pub fn fault(self) -> Option<Fault> {
        #[cfg(any(test, feature = "testing"))]
        return self.fault;
        #[cfg(not(any(test, feature = "testing")))]
        None
    }

    /// The same paths with `fault` planted into their kernels.
    #[cfg(any(test, feature = "testing"))]
    pub fn with_fault(mut self, fault: Option<Fault>) -> Self {
        self.fault = fault;
        self
    }

    /// The empty set with `fault` planted into its kernels. Only test builds can hold a fault: in
    /// production builds this is the empty set (no caller there plants one).
    pub(crate) fn planted(fault: Fault) -> Self {
        #[cfg(any(test, feature = "testing"))]
        return Self::F32.with_fault(Some(fault));
        #[cfg(not(any(test, feature = "testing")))]
        {
            let _ = fault;
            Self::F32
        }
    }
}

impl FromIterator<PathId> for PathSet {
    fn from_iter<I: IntoIterator<Item = PathId>>(iter: I) -> Self {
        iter.into_iter().fold(Self::F32, |s, p| s.with(p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_hold_exactly_what_was_put_in() {
        let s = PathSet::of(&[PathId::Subgroups, PathId::F16Storage]);
        assert!(s.has(PathId::F16Storage) && s.has(PathId::Subgroups));
        assert!(!s.has(PathId::QuantMatmul));
        assert_eq!(
            s.iter().collect::<Vec<_>>(),
            [PathId::F16Storage, PathId::Subgroups]
        );
        assert_eq!(s.without(PathId::F16Storage).len(), 1);
        assert!(PathSet::F32.is_empty() && PathSet::F32.fault().is_none());
        assert_eq!(PathId::ALL.into_iter().collect::<PathSet>().len(), 8);
    }
}
