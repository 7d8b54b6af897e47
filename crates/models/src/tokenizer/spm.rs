//! SentencePiece-style tokenization (`tokenizer.ggml.model = "llama"`), following llama.cpp's
//! `llm_tokenizer_spm_session`.
//!
//! The text (spaces already escaped to "▁") is split into characters; the adjacent pair whose
//! concatenation is the vocabulary token with the highest score is merged, repeatedly (ties: leftmost
//! first). Any pair whose concatenation is a token qualifies, whatever the token's type. A final
//! symbol that is not a token is a single character missing from the vocabulary: it is emitted as its
//! UTF-8 bytes through the `<0xNN>` byte tokens.
//!
//! llama.cpp also keeps a table to undo merges of symbols that are not tokens; since only pairs that
//! form tokens are ever merged, every multi-character symbol is a token and that table is never used.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::vocab::Vocab;

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text when queued; a pair whose symbols changed since is stale.
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// `BinaryHeap` pops the greatest: the highest score, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}

/// Appends the tokens of `text` (already escaped). `byte_token` maps a byte to its fallback token.
pub(crate) fn tokenize(
    vocab: &Vocab,
    text: &str,
    byte_token: &dyn Fn(u8) -> u32,
    out: &mut Vec<u32>,
) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (index, (start, c)) in text.char_indices().enumerate() {
        let len = c.len_utf8();
        symbols.push(Symbol {
            start,
            len,
            prev: index.checked_sub(1),
            next: (start + len < text.len()).then_some(index + 1),
        });
    }

    let mut queue = BinaryHeap::new();
    let push = |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: usize, right: usize| {
        let (l, r) = (symbols[left], symbols[right]);
        let merged = &text[l.start..r.start + r.len];
        if let Some(id) = vocab.get(merged) {
            queue.push(Bigram {
                score: vocab.scores.get(id as usize).copied().unwrap_or(0.0),
                left,
                right,
                size: merged.len(),
            });
        }
    };
    for i in 1..symbols.len() {
        push(&mut queue, &symbols, i - 1, i);
    }

    while let Some(bigram) = queue.pop() {
        let (left, right) = (symbols[bigram.left], symbols[bigram.right]);
        if left.len == 0 || right.len == 0 || left.len + right.len != bigram.size {
            continue;
        }
        symbols[bigram.left].len += right.len;
        symbols[bigram.right].len = 0;
        symbols[bigram.left].next = right.next;
        if let Some(next) = right.next {
            symbols[next].prev = Some(bigram.left);
        }
        if let Some(prev) = symbols[bigram.left].prev {
            push(&mut queue, &symbols, prev, bigram.left);
        }
        if let Some(next) = symbols[bigram.left].next {
            push(&mut queue, &symbols, bigram.left, next);
        }
    }

    // Walk the chain (merged-away symbols have length 0 and are skipped by it).
    let mut at = (!symbols.is_empty()).then_some(0);
    while let Some(i) = at {
        let symbol = symbols[i];
        let piece = &text[symbol.start..symbol.start + symbol.len];
        match vocab.get(piece) {
            Some(id) => out.push(id),
            None => out.extend(piece.bytes().map(byte_token)),
        }
        at = symbol.next;
    }
}
