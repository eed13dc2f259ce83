//! Byte-pair encoding of one word, as HuggingFace tokenizers' `BPE` model does it with an end-of-word
//! suffix: the word's symbols (its last one suffixed), unknown ones as the unknown token, then merges
//! applied lowest rank first (leftmost among equal ranks) until none applies.
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Merge tables: token ids by string, and for each mergeable pair of ids its rank and the merged id.
#[derive(Debug, Clone)]
pub(super) struct Bpe {
    ids: HashMap<String, u32>,
    merges: HashMap<(u32, u32), (u32, u32)>,
    suffix: String,
    unknown: u32,
}

/// One symbol of a word being merged: a token id and its neighbours (`usize::MAX`: none).
#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    live: bool,
}

const NONE: usize = usize::MAX;

impl Bpe {
    /// Tables from `(token, id)` pairs and merges in rank order; a merge of unknown tokens, or whose
    /// result is not a token, is named. (A merge listed twice keeps its last rank, as tokenizers does.)
    pub(super) fn new(tokens: &[(String, u32)], merges: &[(String, String)], suffix: &str, unknown: u32) -> Result<Self, String> {
        let ids: HashMap<String, u32> = tokens.iter().cloned().collect();
        let id = |t: &str| ids.get(t).copied().ok_or_else(|| format!("the merge result or symbol {t:?} is not in the vocabulary"));
        let mut table = HashMap::with_capacity(merges.len());
        for (rank, (a, b)) in merges.iter().enumerate() {
            let rank = u32::try_from(rank).map_err(|_| "too many merges".to_string())?;
            table.insert((id(a)?, id(b)?), (rank, id(&format!("{a}{b}"))?));
        }
        Ok(Bpe { ids, merges: table, suffix: suffix.to_string(), unknown })
    }

    /// Appends the ids of `word` (already byte-level symbols) to `out`.
    pub(super) fn encode_word(&self, word: &str, out: &mut Vec<u32>) {
        let mut symbols = self.symbols(word);
        let mut queue: BinaryHeap<Reverse<(u32, usize, u32)>> = BinaryHeap::with_capacity(symbols.len());
        for pos in 0..symbols.len().saturating_sub(1) {
            if let Some(&(rank, merged)) = self.merges.get(&(symbols[pos].id, symbols[pos + 1].id)) {
                queue.push(Reverse((rank, pos, merged)));
            }
        }
        while let Some(Reverse((_, pos, merged))) = queue.pop() {
            let left = symbols[pos];
            if !left.live || left.next == NONE {
                continue;
            }
            let right = symbols[left.next];
            // A stale entry: the pair at `pos` changed since it was queued.
            if self.merges.get(&(left.id, right.id)).is_none_or(|&(_, m)| m != merged) {
                continue;
            }
            symbols[pos].id = merged;
            symbols[pos].next = right.next;
            symbols[left.next].live = false;
            if right.next != NONE {
                symbols[right.next].prev = pos;
            }
            let here = symbols[pos];
            if here.prev != NONE {
                if let Some(&(rank, m)) = self.merges.get(&(symbols[here.prev].id, here.id)) {
                    queue.push(Reverse((rank, here.prev, m)));
                }
            }
            if here.next != NONE {
                if let Some(&(rank, m)) = self.merges.get(&(here.id, symbols[here.next].id)) {
                    queue.push(Reverse((rank, pos, m)));
                }
            }
        }
        out.extend(symbols.iter().filter(|s| s.live).map(|s| s.id));
    }

    /// The word's starting symbols: one per character, the last with the suffix; unknown ones as the
    /// unknown token.
    fn symbols(&self, word: &str) -> Vec<Symbol> {
        let n = word.chars().count();
        let mut key = String::new();
        word.chars()
            .enumerate()
            .map(|(i, c)| {
                key.clear();
                key.push(c);
                if i + 1 == n {
                    key.push_str(&self.suffix);
                }
                let id = self.ids.get(key.as_str()).copied().unwrap_or(self.unknown);
                Symbol { id, prev: if i == 0 { NONE } else { i - 1 }, next: if i + 1 == n { NONE } else { i + 1 }, live: true }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bpe(tokens: &[&str], merges: &[(&str, &str)]) -> Bpe {
        let tokens: Vec<(String, u32)> = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
        let merges: Vec<(String, String)> = merges.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        Bpe::new(&tokens, &merges, "</w>", 99).unwrap()
    }

    fn encode(b: &Bpe, w: &str) -> Vec<u32> {
        let mut out = Vec::new();
        b.encode_word(w, &mut out);
        out
    }

    #[test]
    fn merges_by_rank_then_leftmost() {
        // tokens: a=0 b=1 a</w>=2 ab=3 aa=4 aa</w>=5 aba</w>=6
        let b = bpe(&["a", "b", "a</w>", "ab", "aa", "aa</w>", "aba</w>"], &[("a", "a</w>"), ("a", "b"), ("a", "a"), ("ab", "a</w>")]);
        assert_eq!(encode(&b, "aba"), vec![6], "a+b, then ab+a</w>");
        assert_eq!(encode(&b, "aaa"), vec![0, 5], "rank 0 (a, a</w>) wins over the leftmost (a, a)");
        assert_eq!(encode(&b, "aaaa"), vec![4, 5]);
        assert_eq!(encode(&b, "ca"), vec![99, 2], "an unknown character is the unknown token");
        assert_eq!(encode(&b, ""), Vec::<u32>::new());
    }

    #[test]
    fn a_merge_outside_the_vocabulary_is_named() {
        let tokens = vec![("a".to_string(), 0), ("b".to_string(), 1)];
        let err = Bpe::new(&tokens, &[("a".into(), "b".into())], "</w>", 0).unwrap_err();
        assert!(err.contains("\"ab\""), "{err}");
    }
}
