//! GPT-2's byte-level alphabet: every byte maps to one printable Unicode character, so a byte string
//! becomes a string BPE merges can work on, and the vocabulary stores tokens in that alphabet
//! ("Ġ" is the byte 0x20, "Ċ" is 0x0A).

use std::sync::OnceLock;

/// Bytes that GPT-2 keeps as the character with the same code point; every other byte is sent to
/// 256, 257, ... in increasing byte order.
fn is_self_mapped(byte: u8) -> bool {
    matches!(byte, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The character that stands for each byte.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for byte in 0..=255u8 {
        table[usize::from(byte)] = if is_self_mapped(byte) {
            char::from(byte)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    table
}

/// The character that stands for `byte`.
pub fn byte_char(byte: u8) -> char {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(byte_to_char_table)[usize::from(byte)]
}

/// The byte a character of the alphabet stands for, or `None` for characters outside it.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    // The alphabet only uses code points below 256 + 256; index a reverse table built once.
    static REVERSE: OnceLock<[Option<u8>; 512]> = OnceLock::new();
    let reverse = REVERSE.get_or_init(|| {
        let mut reverse = [None; 512];
        for (byte, c) in byte_to_char_table().iter().enumerate() {
            if let (Some(slot), Ok(byte)) = (reverse.get_mut(*c as usize), u8::try_from(byte)) {
                *slot = Some(byte);
            }
        }
        reverse
    });
    reverse.get(c as usize).copied().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_round_trips_every_byte() {
        let table = byte_to_char_table();
        for byte in 0..=255u8 {
            assert_eq!(char_to_byte(table[usize::from(byte)]), Some(byte));
        }
        assert_eq!(table[0x20], 'Ġ');
        assert_eq!(table[0x0A], 'Ċ');
        assert_eq!(table[b'a' as usize], 'a');
        assert_eq!(char_to_byte('€'), None);
    }
}
