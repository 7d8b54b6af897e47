//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`), following llama.cpp's `llm_tokenizer_bpe_session`.
//!
//! Each pre-tokenized word is mapped to the byte-level alphabet, split into characters, and the
//! adjacent pair with the lowest merge rank is merged until no ranked pair is left (ties: leftmost
//! first). A final symbol missing from the vocabulary falls back to its single bytes.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::byte_level::byte_to_char_table;
use super::pretokenize::PreTokenizer;
use super::vocab::Vocab;

pub(crate) struct Bpe {
    /// left -> right -> rank (two maps, so a lookup borrows both sides instead of building a key);
    /// the first occurrence of a duplicated merge wins, as in llama.cpp.
    ranks: HashMap<String, HashMap<String, u32>>,
    pre: PreTokenizer,
    ignore_merges: bool,
    byte_chars: Box<[char; 256]>,
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct Bigram {
    rank: u32,
    left: usize,
    right: usize,
    /// The two symbols' lengths when the pair was found: symbols only grow (or die), and their starts
    /// never move, so a pair whose lengths changed since is stale.
    left_len: usize,
    right_len: usize,
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
    /// `BinaryHeap` pops the greatest: make that the lowest rank, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        other.rank.cmp(&self.rank).then(other.left.cmp(&self.left))
    }
}

impl Bpe {
    pub fn new(merges: &[String], pre: PreTokenizer, ignore_merges: bool) -> Self {
        let mut ranks = HashMap::with_capacity(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte (a merge's left side may
            // itself be a space in non-byte-level vocabularies); a merge without one pairs "" with
            // "" and so never applies.
            let space = merge
                .as_bytes()
                .get(1..)
                .and_then(|rest| rest.iter().position(|&b| b == b' '))
                .map(|p| p + 1);
            let (left, right) = match space {
                Some(pos) => (&merge[..pos], &merge[pos + 1..]),
                None => ("", ""),
            };
            ranks
                .entry(left.to_string())
                .or_insert_with(HashMap::new)
                .entry(right.to_string())
                .or_insert(rank as u32);
        }
        Bpe {
            ranks,
            pre,
            ignore_merges,
            byte_chars: Box::new(byte_to_char_table()),
        }
    }

    fn rank(&self, left: &str, right: &str) -> Option<u32> {
        self.ranks.get(left)?.get(right).copied()
    }

    /// Appends the tokens of one text fragment (no special tokens inside).
    pub fn tokenize(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        for word in self.pre.split(text) {
            let encoded: String = word
                .bytes()
                .map(|b| self.byte_chars[usize::from(b)])
                .collect();
            self.tokenize_word(vocab, &encoded, out);
        }
    }

    fn tokenize_word(&self, vocab: &Vocab, word: &str, out: &mut Vec<u32>) {
        if self.ignore_merges
            && let Some(id) = vocab.get(word)
        {
            out.push(id);
            return;
        }
        let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
        for (index, (start, c)) in word.char_indices().enumerate() {
            let len = c.len_utf8();
            symbols.push(Symbol {
                start,
                len,
                prev: index.checked_sub(1),
                next: (start + len < word.len()).then_some(index + 1),
            });
        }
        let text = |s: &Symbol| &word[s.start..s.start + s.len];

        let mut queue = BinaryHeap::new();
        let push =
            |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: usize, right: usize| {
                let (l, r) = (text(&symbols[left]), text(&symbols[right]));
                if let Some(rank) = self.rank(l, r) {
                    queue.push(Bigram {
                        rank,
                        left,
                        right,
                        left_len: l.len(),
                        right_len: r.len(),
                    });
                }
            };
        for i in 1..symbols.len() {
            push(&mut queue, &symbols, i - 1, i);
        }

        while let Some(bigram) = queue.pop() {
            let (left, right) = (symbols[bigram.left], symbols[bigram.right]);
            if left.len == 0 || right.len == 0 {
                continue;
            }
            // Stale: one side has grown since the pair was queued.
            if left.start + left.len != right.start
                || left.len != bigram.left_len
                || right.len != bigram.right_len
            {
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

        for symbol in symbols.iter().filter(|s| s.len > 0) {
            let piece = text(symbol);
            match vocab.get(piece) {
                Some(id) => out.push(id),
                None => {
                    // llama.cpp looks up each byte of the piece as a one-byte token and skips the
                    // bytes that have none; in a byte-level vocabulary every alphabet character is a
                    // token, so this only matters for incomplete vocabularies.
                    for byte in piece.bytes().filter(u8::is_ascii) {
                        if let Some(id) = vocab.get(char::from(byte).encode_utf8(&mut [0; 4])) {
                            out.push(id);
                        }
                    }
                }
            }
        }
    }
}
