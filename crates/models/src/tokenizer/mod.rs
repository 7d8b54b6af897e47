//! Tokenizers of GGUF models, producing the same token ids as llama.cpp for the same text.
//!
//! Two algorithms, chosen by `tokenizer.ggml.model`:
//! - `gpt2`: byte-level BPE with merge ranks after a regex pre-tokenizer chosen by
//!   `tokenizer.ggml.pre` (SmolLM2: `smollm`, which isolates every digit);
//! - `llama`: SentencePiece-style merging by token score with `<0xNN>` byte fallback, spaces written
//!   as "▁" (Gemma 3).
//!
//! Before either runs, special tokens are cut out of the text (llama.cpp's `parse_special`): control
//! tokens such as `<|im_start|>` only when asked, user-defined tokens (Gemma's runs of newlines and
//! spaces, HTML tags) always.
//!
//! A [`Tokenizer`] is built from a plain [`TokenizerSpec`], which [`TokenizerSpec::from_gguf`] reads
//! from a file's metadata.

mod bpe;
mod byte_level;
mod error;
mod llama_unicode;
mod pretokenize;
mod spec;
mod spm;
mod stream;
mod vocab;

#[cfg(test)]
mod tests;

use std::collections::BTreeSet;

use tinygpt_formats::Metadata;

/// The character byte-level BPE vocabularies (GPT-2's) spell byte `b` with.
pub use byte_level::byte_char as byte_level_char;
pub use error::TokenizerError;
pub use spec::{TokenizerModel, TokenizerSpec};
pub use stream::StreamDecoder;

use bpe::Bpe;
use byte_level::char_to_byte;
use vocab::{Fragment, Vocab, attr};

// Texts by which llama.cpp recognises special tokens that converters leave unmarked (its
// `llama_vocab::impl::load`). A token found this way is forced to be a control token, which matters
// for tokenization: control tokens are only matched in text with `parse_special`.

/// End of turn; the first one present becomes the EOT token.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle markers: prefix, suffix, middle, pad, repository, file separator. The last
/// three also end generation.
const FIM_TEXTS: [&[&str]; 6] = [
    &[
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ],
    &[
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ],
    &[
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ],
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

/// Every token with one of these texts ends generation. Note "</s>": Gemma 3 has it as a
/// user-defined HTML tag (strikethrough), and llama.cpp still makes it an end-of-generation control
/// token.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Which special tokens the model defines (after llama.cpp's defaults and range checks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End of turn (`<|im_end|>`, `<end_of_turn>`), from the file or found by its text.
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
}

/// How [`Tokenizer::decode_with`] renders tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Drop a leading BOS and a trailing EOS when the tokenizer adds them (llama.cpp's
    /// `remove_special`).
    pub remove_special: bool,
    /// Render control tokens as their text (llama.cpp's `unparse_special`); otherwise they render
    /// as nothing.
    pub unparse_special: bool,
}

enum Algorithm {
    Bpe(Bpe),
    Spm,
}

/// A tokenizer of one model. Cheap to share (`Sync`); encoding allocates per call only.
pub struct Tokenizer {
    model: TokenizerModel,
    pre: Option<String>,
    vocab: Vocab,
    algorithm: Algorithm,
    /// Each token's bytes as rendered with special tokens shown (llama.cpp's piece cache).
    pieces: Vec<Vec<u8>>,
    special: SpecialTokens,
    eog: BTreeSet<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    /// SentencePiece byte fallback: byte -> token id.
    byte_tokens: Option<Box<[u32; 256]>>,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer, applying llama.cpp's defaults for whatever the spec leaves out.
    pub fn new(spec: TokenizerSpec) -> Result<Self, TokenizerError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        let scores = match spec.scores {
            Some(scores) => check_len("scores", scores, n)?,
            None => vec![0.0; n],
        };
        let mut attrs = match spec.token_types {
            Some(types) => check_len("token types", types, n)?
                .into_iter()
                .map(vocab::attr_from_type)
                .collect(),
            None => vec![attr::NORMAL; n],
        };

        // Defaults by model type, as llama.cpp's `llama_vocab::impl::load`.
        let (algorithm_config, mut special, mut add_bos, mut add_space_prefix, clean_spaces) =
            match spec.model {
                TokenizerModel::Gpt2 => {
                    let config = pretokenize::config_for(spec.pre.as_deref())?;
                    let defaults = SpecialTokens {
                        bos: Some(11),
                        eos: Some(11),
                        ..SpecialTokens::default()
                    };
                    let (add_bos, clean) = (config.add_bos_default, config.clean_spaces);
                    (Some(config), defaults, add_bos, false, clean)
                }
                TokenizerModel::Llama => {
                    let defaults = SpecialTokens {
                        bos: Some(1),
                        eos: Some(2),
                        unk: Some(0),
                        ..SpecialTokens::default()
                    };
                    (None, defaults, true, true, false)
                }
            };
        let mut add_eos = false;
        if let Some(v) = spec.add_space_prefix {
            add_space_prefix = v;
        }
        // Defaults outside the vocabulary are dropped; file values outside it are ignored (llama.cpp
        // warns and keeps the default).
        let in_range = |id: Option<u32>| id.filter(|&id| (id as usize) < n);
        let pick = |file: Option<u32>, default: Option<u32>| in_range(file).or(in_range(default));
        special.bos = pick(spec.bos_id, special.bos);
        special.eos = pick(spec.eos_id, special.eos);
        special.eot = pick(spec.eot_id, None);
        special.eom = pick(spec.eom_id, None);
        special.unk = pick(spec.unk_id, special.unk);
        special.sep = pick(spec.sep_id, special.sep);
        special.pad = pick(spec.pad_id, special.pad);
        if let Some(v) = spec.add_bos {
            add_bos = v;
        }
        if let Some(v) = spec.add_eos {
            add_eos = v;
        }

        let mut vocab = Vocab::new(spec.tokens, scores, Vec::new());

        let eog = detect_special_by_text(&vocab, &mut attrs, &mut special);
        vocab.attrs = attrs;
        vocab.build_special_cache();
        strip_attributes(&mut vocab, spec.model_name.as_deref(), spec.pre.as_deref());

        let algorithm = match algorithm_config {
            Some(config) => {
                let merges = spec
                    .merges
                    .as_deref()
                    .ok_or(TokenizerError::MissingMerges)?;
                let pre = pretokenize::PreTokenizer::new(config.regexes)?;
                Algorithm::Bpe(Bpe::new(merges, pre, config.ignore_merges))
            }
            None => Algorithm::Spm,
        };
        let byte_tokens = match algorithm {
            Algorithm::Spm => Some(spm_byte_tokens(&vocab, special.unk)),
            Algorithm::Bpe(_) => None,
        };

        let mut tokenizer = Tokenizer {
            model: spec.model,
            pre: spec.pre,
            vocab,
            algorithm,
            pieces: Vec::new(),
            special,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            byte_tokens,
            chat_template: spec.chat_template,
        };
        tokenizer.pieces = (0..n as u32).map(|id| tokenizer.render_piece(id)).collect();
        Ok(tokenizer)
    }

    /// Reads the tokenizer of a GGUF file.
    pub fn from_gguf(metadata: &Metadata) -> Result<Self, TokenizerError> {
        Tokenizer::new(TokenizerSpec::from_gguf(metadata)?)
    }

    /// Encodes `text`, recognising special tokens written in it (`<|im_start|>`), as llama.cpp does
    /// for prompts. `add_special` adds BOS/EOS when the model asks for them.
    pub fn encode(&self, text: &str, add_special: bool) -> Vec<u32> {
        self.encode_with(text, add_special, true)
    }

    /// Encodes `text`; with `parse_special` false, control tokens written in the text are tokenized
    /// as plain text (user-defined tokens are still recognised, as in llama.cpp).
    pub fn encode_with(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let fragments = self.vocab.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.special.bos);
        }
        match &self.algorithm {
            Algorithm::Bpe(bpe) => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(range) => bpe.tokenize(&self.vocab, &text[range], &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            Algorithm::Spm => {
                let byte_token = |b: u8| self.byte_tokens.as_ref().map_or(0, |t| t[usize::from(b)]);
                // A space is prefixed to text that starts the input or follows a special token.
                let mut prev_special = true;
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(range) => {
                            let mut escaped = String::with_capacity(range.len() + 3);
                            if self.add_space_prefix && prev_special {
                                escaped.push('▁');
                            }
                            for c in text[range].chars() {
                                escaped.push(if c == ' ' { '▁' } else { c });
                            }
                            spm::tokenize(&self.vocab, &escaped, &byte_token, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.special.eos);
        }
        out
    }

    /// Decodes ids to text as llama.cpp's `llama_detokenize(remove_special = false,
    /// unparse_special = false)`: control tokens render as nothing, invalid UTF-8 (a character cut
    /// by the end of the sequence) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let bytes = self.decode_with(ids, DecodeOptions::default())?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Decodes ids to bytes (a prefix of a generation may end inside a character).
    pub fn decode_with(
        &self,
        mut ids: &[u32],
        options: DecodeOptions,
    ) -> Result<Vec<u8>, TokenizerError> {
        let mut remove_space = self.add_space_prefix;
        if options.remove_special
            && self.add_bos
            && let (Some(&first), Some(bos)) = (ids.first(), self.special.bos)
            && first == bos
        {
            remove_space = false;
            ids = &ids[1..];
        }
        if options.remove_special
            && self.add_eos
            && let (Some(&last), Some(eos)) = (ids.last(), self.special.eos)
            && last == eos
        {
            ids = &ids[..ids.len() - 1];
        }
        let mut out = Vec::new();
        for &id in ids {
            let mut piece = self.token_to_piece(id, options.unparse_special)?;
            // The space SentencePiece prefixed to the input is not part of the text.
            if remove_space && let Some(rest) = piece.strip_prefix(b" ") {
                piece = rest;
            }
            // llama.cpp clears the flag after the first token, even one rendered as nothing.
            remove_space = false;
            out.extend_from_slice(piece);
        }
        if self.clean_spaces {
            clean_up_spaces(&mut out);
        }
        Ok(out)
    }

    /// The bytes token `id` renders as. Control and unknown tokens render as nothing unless
    /// `special`; user-defined tokens always render as their text.
    pub fn token_to_piece(&self, id: u32, special: bool) -> Result<&[u8], TokenizerError> {
        let piece = self
            .pieces
            .get(id as usize)
            .ok_or(TokenizerError::TokenOutOfRange {
                id,
                n_vocab: self.vocab.len(),
            })?;
        if !special && self.vocab.attr(id) & (attr::CONTROL | attr::UNKNOWN) != 0 {
            return Ok(&[]);
        }
        Ok(piece)
    }

    /// A streaming decoder; see [`StreamDecoder`].
    pub fn stream_decoder(&self, special: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, special)
    }

    /// The token's text as stored in the vocabulary ("Ġthe", "▁the", "<0x0A>").
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of the token whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.get(text)
    }

    pub fn n_vocab(&self) -> usize {
        self.vocab.len()
    }

    pub fn model(&self) -> TokenizerModel {
        self.model
    }

    /// The BPE pre-tokenizer name, as given.
    pub fn pre(&self) -> Option<&str> {
        self.pre.as_deref()
    }

    pub fn special_tokens(&self) -> SpecialTokens {
        self.special
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.special.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.special.eos
    }

    /// Whether `encode(.., add_special = true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether generation should stop at `id` (EOS, end of turn, and the like).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// All end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.eog.iter().copied()
    }

    /// Control tokens (BOS, `<|im_start|>`, `<unused12>`): never produced from plain text unless
    /// special tokens are parsed.
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.attr(id) & attr::CONTROL != 0
    }

    /// The Jinja chat template the file carries, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// llama.cpp's `token_to_piece(special = true)`, computed once per token.
    fn render_piece(&self, id: u32) -> Vec<u8> {
        let attr = self.vocab.attr(id);
        let text = &self.vocab.tokens[id as usize];
        if attr & (attr::CONTROL | attr::UNKNOWN | attr::USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if attr & attr::NORMAL != 0 {
            return match self.algorithm {
                Algorithm::Spm => text.replace('▁', " ").into_bytes(),
                Algorithm::Bpe(_) => byte_level_decode(text),
            };
        }
        if attr & attr::BYTE != 0 {
            return parse_byte_token(text).map(|b| vec![b]).unwrap_or_default();
        }
        // Unused and undefined tokens render as nothing.
        Vec::new()
    }
}

/// llama.cpp's recognition of special tokens by their text, in its order: end of turn/message and
/// fill-in-the-middle markers, "unused" control tokens, end-of-generation tokens, then its fix-ups.
/// Updates `attrs` and `special`; returns the end-of-generation set.
///
/// Where several candidates of one kind exist, llama.cpp takes the first in its hash-map order; this
/// takes the first in the lists above (SmolLM2 has both "<|im_end|>" and "<|endoftext|>": llama.cpp
/// 0c1e570 reports EOT = 0 "<|endoftext|>", this picks 2 "<|im_end|>"; both end generation either
/// way).
fn detect_special_by_text(
    vocab: &Vocab,
    attrs: &mut [u32],
    special: &mut SpecialTokens,
) -> BTreeSet<u32> {
    let first_of = |texts: &[&str]| texts.iter().find_map(|t| vocab.get(t));
    // Only tokens found by text are forced to control; ids the file gives are taken as they are.
    let mut detected = Vec::new();
    if special.eot.is_none() {
        special.eot = first_of(EOT_TEXTS);
        detected.extend(special.eot);
    }
    if special.eom.is_none() {
        special.eom = vocab.get("<|eom_id|>");
        detected.extend(special.eom);
    }
    let fim: Vec<Option<u32>> = FIM_TEXTS.iter().map(|texts| first_of(texts)).collect();
    detected.extend(fim.iter().copied().flatten());
    for id in detected {
        attrs[id as usize] |= attr::CONTROL;
    }

    for (id, text) in vocab.tokens.iter().enumerate() {
        if attrs[id] & attr::CONTROL != 0 && text.contains("unused") {
            attrs[id] |= attr::UNUSED;
        }
    }

    // fill-in-the-middle pad, repository and file separator end generation
    let mut eog: BTreeSet<u32> = fim[3..].iter().copied().flatten().collect();
    for text in EOG_TEXTS {
        if let Some(id) = vocab.get(text) {
            eog.insert(id);
            attrs[id as usize] |= attr::CONTROL;
        }
    }
    // gpt-oss: these are always rendered.
    for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
        if let Some(id) = vocab.get(text) {
            attrs[id as usize] = attr::USER_DEFINED;
        }
    }
    eog.extend(
        [special.eos, special.eot, special.eom]
            .into_iter()
            .flatten(),
    );

    let eog_has =
        |eog: &BTreeSet<u32>, text: &str| vocab.get(text).is_some_and(|id| eog.contains(&id));
    // o200k_harmony / solar-open: "<|end|>" ends a message, not the generation.
    if let Some(end) = vocab.get("<|end|>").filter(|id| eog.contains(id)) {
        let has_call = eog_has(&eog, "<|call|>") || eog_has(&eog, "<|calls|>");
        if has_call && (eog_has(&eog, "<|return|>") || eog_has(&eog, "<|flush|>")) {
            eog.remove(&end);
            attrs[end as usize] = attr::USER_DEFINED;
        }
    }
    // Gemma 4 and PLaMo have a normal "</s>".
    if let Some(s) = vocab.get("</s>").filter(|id| eog.contains(id))
        && (eog_has(&eog, "<|tool_response>") || eog_has(&eog, "<|plamo:eos|>"))
    {
        eog.remove(&s);
        attrs[s as usize] = attr::NORMAL;
    }
    eog
}

fn check_len<T>(what: &'static str, v: Vec<T>, expected: usize) -> Result<Vec<T>, TokenizerError> {
    // llama.cpp only refuses arrays shorter than the vocabulary; longer ones are cut.
    if v.len() < expected {
        return Err(TokenizerError::LengthMismatch {
            what,
            got: v.len(),
            expected,
        });
    }
    let mut v = v;
    v.truncate(expected);
    Ok(v)
}

/// The token for each byte in SentencePiece byte fallback: `<0xNN>`, else the byte itself as a
/// one-character token, else (where llama.cpp would fail) the unknown token.
fn spm_byte_tokens(vocab: &Vocab, unk: Option<u32>) -> Box<[u32; 256]> {
    let mut table = Box::new([unk.unwrap_or(0); 256]);
    for byte in 0..=255u8 {
        let hex = format!("<0x{byte:02X}>");
        let found = vocab.get(&hex).or_else(|| {
            byte.is_ascii()
                .then(|| vocab.get(char::from(byte).encode_utf8(&mut [0; 4])))
                .flatten()
        });
        if let Some(id) = found {
            table[usize::from(byte)] = id;
        }
    }
    table
}

/// `<0xNN>` -> NN.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

/// A byte-level BPE token's text back to bytes. A character outside the byte alphabet is rendered the
/// way llama.cpp does, as a visible `[UNK_BYTE_0x..]` marker.
fn byte_level_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                for b in c.encode_utf8(&mut [0; 4]).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// The whitespace-stripping attributes llama.cpp gives tokens by model name and pre-tokenizer (the end
/// of `llama_vocab::impl::load`). Phi-3's special tokens drop the whitespace after them (except
/// `<unk>`, `<s>` and `<|endoftext|>`), so "<|user|>\n Hi" tokenizes as "<|user|>" "Hi"; the mask
/// tokens of Jina v2 and ModernBERT drop the whitespace before them.
fn strip_attributes(vocab: &mut Vocab, model_name: Option<&str>, pre: Option<&str>) {
    let name = model_name.unwrap_or("").to_ascii_lowercase();
    let pre = pre.unwrap_or("");
    let set = |vocab: &mut Vocab, text: &str, bit: u32, on: bool| {
        if let Some(id) = vocab.get(text) {
            vocab.set_attr(id, bit, on);
        }
    };
    if ["jina-v2-de", "jina-v2-es", "jina-v2-code"]
        .iter()
        .any(|p| pre.contains(p))
    {
        set(vocab, "<mask>", attr::LSTRIP, true);
    } else if name.contains("phi-3") || name.contains("phi3") {
        let ids = vocab.special_ids().to_vec();
        for id in ids {
            vocab.set_attr(id, attr::RSTRIP, true);
        }
        set(vocab, "</s>", attr::RSTRIP, true);
        for t in ["<unk>", "<s>", "<|endoftext|>"] {
            set(vocab, t, attr::RSTRIP, false);
        }
    } else if name.contains("modern-bert") {
        set(vocab, "[MASK]", attr::LSTRIP, true);
    }
}

/// llama.cpp's `clean_spaces` passes over detokenized bytes, transcribed literally (they compact
/// in place, and the second pass blanks the byte it skips, which later checks then see):
/// " ?", " !", " .", " ," lose the space; a lone apostrophe between spaces loses both spaces;
/// " 's", " 'm", " 're", " 've" lose the space.
fn clean_up_spaces(text: &mut Vec<u8>) {
    let mut total = text.len();

    let n = total;
    total = usize::from(n > 0);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        text[total] = x;
        total += 1;
    }

    let n = total;
    total = usize::from(n > 0);
    let mut i = 1;
    while i < n {
        let x = text[i];
        if x == b'\'' && i + 1 < n && text[i - 1] == b' ' && text[i + 1] == b' ' {
            total -= 1;
            i += 1;
            text[i] = 0;
        }
        text[total] = x;
        total += 1;
        i += 1;
    }

    let n = total;
    total = usize::from(n > 0);
    for i in 1..n {
        let x = text[i];
        if text[i - 1] == b' ' && x == b'\'' && i + 1 < n {
            let x1 = text[i + 1];
            let drop_space = match x1 {
                b's' | b'm' => true,
                b'r' | b'v' => i + 2 < n && text[i + 2] == b'e',
                _ => false,
            };
            if drop_space {
                total -= 1;
            }
        }
        text[total] = x;
        total += 1;
    }
    text.truncate(total);
}
