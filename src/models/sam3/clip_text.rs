//! CLIP's text before byte-pair encoding, as transformers' `CLIPTokenizer` prepares it: special tokens
//! found in the raw text, the rest normalised (NFC, runs of whitespace to one space, lower case), split
//! into words by CLIP's pattern
//! `<|startoftext|>|<|endoftext|>|'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+` (whitespace
//! dropped), and each word's bytes written as GPT-2's byte-level symbols.
use unicode_normalization_alignments::UnicodeNormalization;

use super::unicode_classes::{LETTER, NUMBER};

/// A piece of a prompt: a special token (by its index in the list given) or text to tokenize.
#[derive(Debug, PartialEq)]
pub(super) enum Piece<'a> {
    /// The special token at this index.
    Special(usize),
    /// Text between special tokens.
    Text(&'a str),
}

/// `text` cut at each occurrence of a `specials` string (the leftmost first, the longest at a tie).
pub(super) fn split_specials<'a>(mut text: &'a str, specials: &[&str]) -> Vec<Piece<'a>> {
    let mut pieces = Vec::new();
    loop {
        let next = specials
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(k, s)| text.find(s).map(|at| (at, std::cmp::Reverse(s.len()), k)))
            .min();
        let Some((at, std::cmp::Reverse(len), k)) = next else { break };
        if at > 0 {
            pieces.push(Piece::Text(&text[..at]));
        }
        pieces.push(Piece::Special(k));
        text = &text[at + len..];
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    pieces
}

/// NFC, every run of whitespace as one space, then each character lower-cased on its own.
pub(super) fn normalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_space = false;
    for (c, _) in text.nfc() {
        if c.is_whitespace() {
            if !in_space {
                out.push(' ');
            }
            in_space = true;
        } else {
            out.extend(c.to_lowercase());
            in_space = false;
        }
    }
    out
}

/// CLIP's words of normalised `text`, in order.
pub(super) fn words(text: &str) -> Vec<&str> {
    const FIXED: [&str; 9] = ["<|startoftext|>", "<|endoftext|>", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d"];
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        let len = if let Some(f) = FIXED.iter().find(|f| rest.starts_with(**f)) {
            f.len()
        } else if is_letter(c) {
            run_len(rest, is_letter)
        } else if is_number(c) {
            c.len_utf8()
        } else if c.is_whitespace() {
            rest = &rest[c.len_utf8()..];
            continue;
        } else {
            run_len(rest, |c| !(c.is_whitespace() || is_letter(c) || is_number(c)))
        };
        out.push(&rest[..len]);
        rest = &rest[len..];
    }
    out
}

/// The byte length of the run of characters at the start of `s` that satisfy `keep`.
fn run_len(s: &str, keep: impl Fn(char) -> bool) -> usize {
    s.char_indices().find(|&(_, c)| !keep(c)).map_or(s.len(), |(i, _)| i)
}

/// Unicode general category L.
fn is_letter(c: char) -> bool {
    c.is_ascii_alphabetic() || (!c.is_ascii() && in_ranges(LETTER, c))
}

/// Unicode general category N.
fn is_number(c: char) -> bool {
    c.is_ascii_digit() || (!c.is_ascii() && in_ranges(NUMBER, c))
}

/// Whether `c` lies in one of the sorted, disjoint `ranges`.
fn in_ranges(ranges: &[(u32, u32)], c: char) -> bool {
    let c = c as u32;
    ranges
        .binary_search_by(|&(lo, hi)| {
            if hi < c {
                std::cmp::Ordering::Less
            } else if lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

/// `word`'s bytes as GPT-2's byte-level symbols: printable Latin-1 bytes stand for themselves, the
/// other 68 for U+0100 onwards in byte order.
pub(super) fn byte_level(word: &str) -> String {
    word.bytes().map(byte_symbol).collect()
}

/// The byte-level symbol of one byte.
fn byte_symbol(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_follow_clips_pattern() {
        assert_eq!(words("a dog's 12 toys!!"), ["a", "dog", "'s", "1", "2", "toys", "!!"]);
        assert_eq!(words("!'s it'll"), ["!'", "s", "it", "'ll"]);
        assert_eq!(words("x<|endoftext|>"), ["x", "<|endoftext|>"]);
        assert_eq!(words("!<|endoftext|>"), ["!<|", "endoftext", "|>"], "a run of punctuation takes the `<|`");
        assert_eq!(words("<|endoftext|>é"), ["<|endoftext|>", "é"]);
        assert_eq!(words("ⅻ٣"), ["ⅻ", "٣"], "letter numbers and Arabic digits are numbers, one by one");
    }

    #[test]
    fn normalisation_composes_collapses_and_lowers() {
        assert_eq!(normalize("E\u{301}COLE \t\n  Vert"), "\u{e9}cole vert");
    }

    #[test]
    fn specials_are_cut_leftmost() {
        let s = ["<|startoftext|>", "<|endoftext|>"];
        assert_eq!(split_specials("a<|endoftext|>b<|startoftext|>", &s), [Piece::Text("a"), Piece::Special(1), Piece::Text("b"), Piece::Special(0)]);
    }

    #[test]
    fn byte_level_symbols_are_gpt2s() {
        assert_eq!(byte_level("a b"), "a\u{120}b");
        assert_eq!(byte_symbol(0), '\u{100}');
        assert_eq!(byte_symbol(0xAD), '\u{143}');
        assert_eq!(byte_level("é"), "\u{c3}\u{a9}");
    }
}
