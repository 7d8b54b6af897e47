//! The vocabulary shared by both algorithms: token texts, scores, attributes, and the splitting of
//! input text around special tokens.

use std::collections::HashMap;
use std::ops::Range;

use aho_corasick::AhoCorasick;

/// Token attributes, as llama.cpp's `llama_token_attr` bits.
pub(crate) mod attr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;
    /// Whitespace before the token is dropped when it is cut out of the text.
    pub const LSTRIP: u32 = 1 << 7;
    /// Whitespace after the token is dropped when it is cut out of the text.
    pub const RSTRIP: u32 = 1 << 8;
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`) to attributes; a missing array means every
/// token is normal.
pub(crate) fn attr_from_type(token_type: i32) -> u32 {
    match token_type {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        // 0 ("undefined") and anything else: llama.cpp's UNDEFINED, which renders as nothing.
        _ => 0,
    }
}

/// A part of the input: text still to tokenize, or a special token already recognised.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

pub(crate) struct Vocab {
    pub tokens: Vec<String>,
    pub token_to_id: HashMap<String, u32>,
    pub scores: Vec<f32>,
    pub attrs: Vec<u32>,
    /// Tokens matched literally in the input before tokenization (control, user-defined and unknown
    /// ones), longest text first.
    special: Vec<u32>,
    /// Finds which of `special` occur in a text at all, so the partition below only walks those.
    special_matcher: Option<AhoCorasick>,
}

impl Vocab {
    pub fn new(mut tokens: Vec<String>, scores: Vec<f32>, attrs: Vec<u32>) -> Self {
        let mut token_to_id = HashMap::with_capacity(tokens.len());
        for (i, text) in tokens.iter_mut().enumerate() {
            // llama.cpp renames empty tokens so that they can never match text.
            if text.is_empty() {
                *text = format!("[EMPTY_{i}]");
            }
            // Later duplicates win, as in llama.cpp's `token_to_id[word] = i`.
            token_to_id.insert(text.clone(), i as u32);
        }
        Vocab {
            tokens,
            token_to_id,
            scores,
            attrs,
            special: Vec::new(),
            special_matcher: None,
        }
    }

    /// Call once the attributes are final.
    pub fn build_special_cache(&mut self) {
        let mut special: Vec<u32> = (0..self.tokens.len() as u32)
            .filter(|&id| {
                self.attrs[id as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
            })
            .collect();
        // llama.cpp sorts by length only (unstable); ties are broken by id here so the order is
        // deterministic. Equal-length special tokens can only compete when their texts overlap in
        // the input, which none of the supported vocabularies' special tokens do.
        special.sort_by(|&a, &b| {
            let (la, lb) = (self.tokens[a as usize].len(), self.tokens[b as usize].len());
            lb.cmp(&la).then(a.cmp(&b))
        });
        self.special_matcher = if special.is_empty() {
            None
        } else {
            AhoCorasick::new(special.iter().map(|&id| self.tokens[id as usize].as_str())).ok()
        };
        self.special = special;
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn get(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    pub fn attr(&self, id: u32) -> u32 {
        self.attrs.get(id as usize).copied().unwrap_or(0)
    }

    /// Sets or clears attribute `bit` of token `id`.
    pub fn set_attr(&mut self, id: u32, bit: u32, on: bool) {
        if let Some(a) = self.attrs.get_mut(id as usize) {
            *a = if on { *a | bit } else { *a & !bit };
        }
    }

    /// The special tokens partitions cut out (control, user-defined and unknown ones).
    pub fn special_ids(&self) -> &[u32] {
        &self.special
    }

    /// Splits `text` around special tokens the way llama.cpp's `tokenizer_st_partition` does: each
    /// special token, longest first, is cut out of every remaining text fragment, left to right.
    /// Control and unknown tokens are only recognised with `parse_special`; user-defined tokens
    /// always are. A token with [`attr::LSTRIP`] / [`attr::RSTRIP`] takes the ASCII whitespace
    /// before / after it along (C's `isspace`, as llama.cpp).
    pub fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(0..text.len())];
        let Some(matcher) = &self.special_matcher else {
            return fragments;
        };
        // Which special tokens occur anywhere in the text (overlaps included): a token absent from
        // the whole text is absent from each of its fragments, so skipping it changes nothing.
        let mut present = vec![false; self.special.len()];
        for m in matcher.find_overlapping_iter(text) {
            present[m.pattern().as_usize()] = true;
        }
        for (index, &id) in self.special.iter().enumerate() {
            if !present[index] {
                continue;
            }
            if !parse_special && self.attr(id) & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(range) = fragment else {
                    next.push(fragment);
                    continue;
                };
                let (lstrip, rstrip) = (
                    self.attr(id) & attr::LSTRIP != 0,
                    self.attr(id) & attr::RSTRIP != 0,
                );
                let bytes = text.as_bytes();
                let mut start = range.start;
                while let Some(found) = text[start..range.end].find(needle) {
                    let at = start + found;
                    let mut left_end = at;
                    if lstrip {
                        while left_end > start && is_c_space(bytes[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > start {
                        next.push(Fragment::Text(start..left_end));
                    }
                    next.push(Fragment::Token(id));
                    start = at + needle.len();
                    if rstrip {
                        while start < range.end && is_c_space(bytes[start]) {
                            start += 1;
                        }
                    }
                }
                if start < range.end {
                    next.push(Fragment::Text(start..range.end));
                }
            }
            fragments = next;
        }
        fragments
    }
}

/// C's `isspace` in the "C" locale: space, \t, \n, \v, \f, \r.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}
