//! Incremental detokenization for generation: token pieces are bytes, and a multi-byte character
//! (an emoji, a CJK character) can be split across tokens, so text is released only once it is
//! complete UTF-8.

use super::{Tokenizer, TokenizerError};

/// Turns a stream of token ids into text, holding back an incomplete trailing UTF-8 sequence until
/// the tokens that complete it arrive. Bytes that can never become valid UTF-8 are replaced by
/// U+FFFD as soon as that is certain.
///
/// Each piece is rendered as [`Tokenizer::token_to_piece`] does; unlike [`Tokenizer::decode`], no
/// leading space is stripped and no space clean-up is applied, since a stream usually continues a
/// prompt.
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    special: bool,
    pending: Vec<u8>,
}

impl<'t> StreamDecoder<'t> {
    /// `special`: render control tokens (such as `<|im_end|>`) as their text instead of nothing.
    pub fn new(tokenizer: &'t Tokenizer, special: bool) -> Self {
        StreamDecoder {
            tokenizer,
            special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let piece = self.tokenizer.token_to_piece(id, self.special)?;
        self.pending.extend_from_slice(piece);
        Ok(self.take_complete())
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: whatever is held back can no longer be completed and becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(valid) => {
                    out.push_str(valid);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid_end = start + e.valid_up_to();
                    // The prefix was just checked, so this conversion cannot fail.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid_end]));
                    match e.error_len() {
                        // An invalid sequence: it stays invalid whatever follows.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid_end + len;
                        }
                        // A truncated character at the end: wait for more bytes.
                        None => {
                            start = valid_end;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
