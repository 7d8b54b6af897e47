//! The character vocabulary, the 90/10 train/val split, and reproducible batches.

use serde::{Deserialize, Serialize};

/// Characters of the training text, sorted: id i is the i-th character.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CharVocab {
    pub chars: Vec<char>,
}

/// Why a text cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("the training text is empty")]
    Empty,
    #[error("the text is not UTF-8 (first bad byte at offset {0}); give a UTF-8 text file")]
    NotUtf8(usize),
    #[error(
        "the text has {chars} characters; with block size {block} each split needs more than {block} \
         (the validation split is 10% of the text): use a longer text or a smaller --block-size"
    )]
    TooShort { chars: usize, block: usize },
    #[error("character {0:?} is not in the model's vocabulary")]
    UnknownChar(char),
}

impl CharVocab {
    /// The sorted distinct characters of `text`.
    pub fn from_text(text: &str) -> Self {
        let mut chars: Vec<char> = text
            .chars()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        chars.shrink_to_fit();
        CharVocab { chars }
    }
    pub fn len(&self) -> usize {
        self.chars.len()
    }
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        text.chars()
            .map(|c| {
                self.chars
                    .binary_search(&c)
                    .map(|i| i as u32)
                    .map_err(|_| DataError::UnknownChar(c))
            })
            .collect()
    }
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .filter_map(|&i| self.chars.get(i as usize))
            .collect()
    }
}

/// A tokenized text split 90/10 by position, as nanoGPT splits it.
pub struct Dataset {
    pub vocab: CharVocab,
    pub train: Vec<u32>,
    pub val: Vec<u32>,
}

impl Dataset {
    /// Builds the vocabulary from `bytes` (which must be UTF-8) and splits it.
    pub fn from_bytes(bytes: &[u8], block: usize) -> Result<Self, DataError> {
        let text = std::str::from_utf8(bytes).map_err(|e| DataError::NotUtf8(e.valid_up_to()))?;
        if text.is_empty() {
            return Err(DataError::Empty);
        }
        let vocab = CharVocab::from_text(text);
        Self::with_vocab(text, vocab, block)
    }

    /// Splits `text` with a given vocabulary (a checkpoint's), refusing characters it lacks.
    pub fn with_vocab(text: &str, vocab: CharVocab, block: usize) -> Result<Self, DataError> {
        let ids = vocab.encode(text)?;
        let n = ids.len() * 9 / 10;
        let (train, val) = (ids[..n].to_vec(), ids[n..].to_vec());
        if train.len() <= block + 1 || val.len() <= block + 1 {
            return Err(DataError::TooShort {
                chars: ids.len(),
                block,
            });
        }
        Ok(Dataset { vocab, train, val })
    }

    /// `batch` windows of `block` tokens (inputs) and the same windows shifted by one (targets), at
    /// offsets drawn from (seed, stream, index): the same call always gives the same batch, so a resumed
    /// run sees the batches an uninterrupted one would have.
    pub fn batch(
        &self,
        val: bool,
        seed: u64,
        index: u64,
        batch: usize,
        block: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        let data = if val { &self.val } else { &self.train };
        let mut rng = tinygpt_kernels::rng::SeedRng::new(
            seed ^ (index.wrapping_mul(0x9E37_79B9_7F4A_7C15)) ^ if val { 0x5A5A_5A5A } else { 0 },
        );
        let span = data.len() - block - 1;
        let mut x = Vec::with_capacity(batch * block);
        let mut y = Vec::with_capacity(batch * block);
        for _ in 0..batch {
            let o = rng.below(span + 1);
            x.extend_from_slice(&data[o..o + block]);
            y.extend_from_slice(&data[o + 1..o + 1 + block]);
        }
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_split_and_batches() {
        let text = "hello world, hello tiny gpt! ".repeat(20);
        let d = Dataset::from_bytes(text.as_bytes(), 8).unwrap();
        assert_eq!(d.vocab.decode(&d.vocab.encode("hello").unwrap()), "hello");
        assert_eq!(d.train.len() + d.val.len(), text.chars().count());
        let (x, y) = d.batch(false, 1, 5, 3, 8);
        assert_eq!(x.len(), 24);
        assert_eq!(&x[1..8], &y[0..7], "targets are inputs shifted by one");
        assert_eq!(
            d.batch(false, 1, 5, 3, 8),
            (x.clone(), y),
            "batches are reproducible"
        );
        assert_ne!(d.batch(false, 1, 6, 3, 8).0, x);
    }

    #[test]
    fn bad_texts_are_refused_with_reasons() {
        assert!(matches!(Dataset::from_bytes(b"", 8), Err(DataError::Empty)));
        assert!(matches!(
            Dataset::from_bytes(&[0x61, 0xff, 0x62], 8),
            Err(DataError::NotUtf8(1))
        ));
        assert!(matches!(
            Dataset::from_bytes(b"short text", 8),
            Err(DataError::TooShort { .. })
        ));
        let v = CharVocab::from_text("abc");
        assert!(matches!(v.encode("abd"), Err(DataError::UnknownChar('d'))));
    }
}
