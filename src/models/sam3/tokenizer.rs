//! SAM 3's text tokenizer: CLIP's byte-level BPE as transformers' `CLIPTokenizer` (5.24) tokenizes
//! — NFC, runs of whitespace to one space, lower case; CLIP's word pattern; byte-level symbols; BPE
//! with `</w>` ending each word; `<|startoftext|>` and `<|endoftext|>` as special tokens — from the
//! checkpoint's own vocabulary (`tokenizer.json`, or `vocab.json` with `merges.txt`, or a GGUF's
//! copy). A prompt becomes start + its first `context − 2` tokens + end, padded with the end token
//! to the text context; the mask marks the tokens. (The original package also applies ftfy and
//! unescapes HTML before this; docs/sam3.md.)
use std::collections::BTreeMap;
use std::path::Path;

use super::bpe::Bpe;
use super::clip_text::{byte_level, normalize, split_specials, words, Piece};
use crate::error::{Error, Result};
use crate::weights::MetaValue;

/// The largest tokenizer file read (CLIP's `tokenizer.json` is 3.6 MB).
pub const MAX_TOKENIZER_FILE: u64 = 32 << 20;
/// The most merges a vocabulary may list (CLIP has 48,894).
pub const MAX_MERGES: usize = 1 << 20;
/// The longest prompt tokenized, in bytes (anything past the context is cut anyway).
pub const MAX_PROMPT_BYTES: usize = 1 << 16;
/// CLIP's start token.
pub const START: &str = "<|startoftext|>";
/// CLIP's end (and padding) token.
pub const END: &str = "<|endoftext|>";

/// GGUF metadata keys of a stored vocabulary.
const META_TOKENS: &str = "edgerun.tokenizer.tokens";
const META_IDS: &str = "edgerun.tokenizer.ids";
const META_MERGES: &str = "edgerun.tokenizer.merges";

/// A BPE vocabulary: tokens with their ids, and the merges in rank order.
#[derive(Debug, Clone, PartialEq)]
pub struct BpeVocabulary {
    tokens: Vec<(String, u32)>,
    merges: Vec<(String, String)>,
}

impl BpeVocabulary {
    /// The vocabulary stored beside a model: `tokenizer.json`, else `vocab.json` + `merges.txt`, in the
    /// model directory (or beside a weight file); `None` when there is neither.
    pub fn beside(model: &Path) -> Result<Option<Self>> {
        let dir = if model.is_dir() { model.to_path_buf() } else { model.parent().map(Path::to_path_buf).unwrap_or_default() };
        let json = dir.join("tokenizer.json");
        if json.exists() {
            return Self::from_tokenizer_json(&json).map(Some);
        }
        let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
        if vocab.exists() && merges.exists() {
            return Self::from_vocab_merges(&vocab, &merges).map(Some);
        }
        Ok(None)
    }

    /// Reads a transformers `tokenizer.json` whose model is BPE.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self> {
        let bad = |m: String| Error::bad_file(path, m);
        let bytes = crate::fsutil::read_input(path, MAX_TOKENIZER_FILE)?;
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let model = v.get("model").ok_or_else(|| bad("no `model`".into()))?;
        if let Some(t) = model.get("type").and_then(|t| t.as_str()) {
            if t != "BPE" {
                return Err(bad(format!("a `{t}` tokenizer; SAM 3 needs CLIP's BPE")));
            }
        }
        let vocab = model.get("vocab").and_then(|v| v.as_object()).ok_or_else(|| bad("`model.vocab` is not a token → id map".into()))?;
        let vocab = vocab
            .iter()
            .map(|(t, id)| id.as_u64().map(|id| (t.clone(), id)).ok_or_else(|| bad(format!("token {t:?} has id {id}, not a whole number"))))
            .collect::<Result<Vec<_>>>()?;
        let merges = model.get("merges").and_then(|m| m.as_array()).ok_or_else(|| bad("`model.merges` is not a list".into()))?;
        let merges = merges
            .iter()
            .enumerate()
            .map(|(i, m)| match m {
                serde_json::Value::String(s) => split_merge(s).ok_or_else(|| bad(format!("merge {i} ({s:?}) is not two symbols"))),
                serde_json::Value::Array(a) => match a.as_slice() {
                    [serde_json::Value::String(x), serde_json::Value::String(y)] => Ok((x.clone(), y.clone())),
                    _ => Err(bad(format!("merge {i} is not a pair of strings"))),
                },
                _ => Err(bad(format!("merge {i} is neither \"a b\" nor [a, b]"))),
            })
            .collect::<Result<Vec<_>>>()?;
        Self::checked(vocab, merges).map_err(bad)
    }

    /// Reads `vocab.json` (token → id) and `merges.txt` (one `a b` per line after a `#version` line).
    pub fn from_vocab_merges(vocab_path: &Path, merges_path: &Path) -> Result<Self> {
        let bytes = crate::fsutil::read_input(vocab_path, MAX_TOKENIZER_FILE)?;
        let map: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&bytes).map_err(|e| Error::bad_file(vocab_path, format!("not a token → id map: {e}")))?;
        let vocab = map
            .into_iter()
            .map(|(t, id)| id.as_u64().map(|id| (t.clone(), id)).ok_or_else(|| Error::bad_file(vocab_path, format!("token {t:?} has id {id}, not a whole number"))))
            .collect::<Result<Vec<_>>>()?;
        let text = crate::fsutil::read_input_text(merges_path, MAX_TOKENIZER_FILE)?;
        let merges = text
            .lines()
            .enumerate()
            .filter(|(i, l)| !(l.is_empty() || (*i == 0 && l.starts_with("#version"))))
            .map(|(i, l)| split_merge(l).ok_or_else(|| Error::bad_file(merges_path, format!("line {}: {l:?} is not two symbols", i + 1))))
            .collect::<Result<Vec<_>>>()?;
        Self::checked(vocab, merges).map_err(|m| Error::bad_file(vocab_path, m))
    }

    /// The vocabulary that `edgerun quantize` stored in a GGUF's metadata, when there is one.
    pub fn from_metadata(meta: &BTreeMap<String, MetaValue>) -> std::result::Result<Option<Self>, String> {
        let strings = |key: &str| -> std::result::Result<Option<Vec<String>>, String> {
            match meta.get(key) {
                None => Ok(None),
                Some(MetaValue::Array(a)) => a.iter().map(|v| v.as_str().map(str::to_string).ok_or_else(|| format!("`{key}` holds a non-string"))).collect::<std::result::Result<_, _>>().map(Some),
                Some(_) => Err(format!("`{key}` is not an array")),
            }
        };
        let (Some(tokens), Some(merges)) = (strings(META_TOKENS)?, strings(META_MERGES)?) else { return Ok(None) };
        let ids: Vec<u64> = match meta.get(META_IDS) {
            Some(MetaValue::Array(a)) => a.iter().map(|v| v.as_u64().ok_or_else(|| format!("`{META_IDS}` holds a non-id"))).collect::<std::result::Result<_, _>>()?,
            _ => return Err(format!("`{META_TOKENS}` without `{META_IDS}`")),
        };
        if ids.len() != tokens.len() {
            return Err(format!("{} tokens but {} ids", tokens.len(), ids.len()));
        }
        let merges = merges.iter().map(|m| split_merge(m).ok_or_else(|| format!("merge {m:?} is not two symbols"))).collect::<std::result::Result<Vec<_>, _>>()?;
        Self::checked(tokens.into_iter().zip(ids).collect(), merges).map(Some)
    }

    /// Its GGUF metadata entries (what [`BpeVocabulary::from_metadata`] reads back).
    pub fn metadata(&self) -> Vec<(String, MetaValue)> {
        vec![
            (META_TOKENS.into(), MetaValue::Array(self.tokens.iter().map(|(t, _)| MetaValue::String(t.clone())).collect())),
            (META_IDS.into(), MetaValue::Array(self.tokens.iter().map(|&(_, i)| MetaValue::U32(i)).collect())),
            (META_MERGES.into(), MetaValue::Array(self.merges.iter().map(|(a, b)| MetaValue::String(format!("{a} {b}"))).collect())),
        ]
    }

    /// Bounds and checks: ids fit u32 and are distinct, tokens are distinct, the merge count is bounded.
    fn checked(vocab: Vec<(String, u64)>, merges: Vec<(String, String)>) -> std::result::Result<Self, String> {
        if vocab.is_empty() {
            return Err("an empty vocabulary".into());
        }
        if merges.len() > MAX_MERGES {
            return Err(format!("{} merges; at most {MAX_MERGES} are read", merges.len()));
        }
        let mut seen_ids = std::collections::HashSet::new();
        let mut seen_tokens = std::collections::HashSet::new();
        let mut tokens = Vec::with_capacity(vocab.len());
        for (t, id) in vocab {
            let id = u32::try_from(id).map_err(|_| format!("token {t:?} has id {id}, beyond u32"))?;
            if !seen_ids.insert(id) {
                return Err(format!("id {id} is given to two tokens"));
            }
            if !seen_tokens.insert(t.clone()) {
                return Err(format!("token {t:?} is listed twice"));
            }
            tokens.push((t, id));
        }
        tokens.sort_by_key(|&(_, id)| id);
        Ok(BpeVocabulary { tokens, merges })
    }

    /// The id of `token`.
    fn id(&self, token: &str) -> Option<u32> {
        self.tokens.iter().find(|(t, _)| t == token).map(|&(_, id)| id)
    }
}

/// `"a b"` → `(a, b)`.
fn split_merge(s: &str) -> Option<(String, String)> {
    let (a, b) = s.split_once(' ')?;
    (!a.is_empty() && !b.is_empty() && !b.contains(' ')).then(|| (a.to_string(), b.to_string()))
}

/// CLIP's tokenizer for prompts of `context` tokens.
#[derive(Debug, Clone)]
pub struct ClipTokenizer {
    bpe: Bpe,
    start: u32,
    end: u32,
    context: usize,
}

impl ClipTokenizer {
    /// Builds the tokenizer from `vocab` for a text encoder of `vocab_size` tokens and `context` positions.
    pub fn new(vocab: &BpeVocabulary, context: usize, vocab_size: usize) -> Result<Self> {
        if let Some((t, id)) = vocab.tokens.iter().find(|(_, id)| *id as usize >= vocab_size) {
            return Err(Error::Config(format!("tokenizer: token {t:?} has id {id}, beyond the text encoder's {vocab_size} tokens")));
        }
        let start = vocab.id(START).ok_or_else(|| Error::Config(format!("tokenizer: no `{START}` token")))?;
        let end = vocab.id(END).ok_or_else(|| Error::Config(format!("tokenizer: no `{END}` token")))?;
        if context < 2 {
            return Err(Error::Config(format!("a text context of {context} holds no prompt")));
        }
        let bpe = Bpe::new(&vocab.tokens, &vocab.merges, "</w>", end).map_err(|e| Error::Config(format!("tokenizer: {e}")))?;
        Ok(ClipTokenizer { bpe, start, end, context })
    }

    /// The ids of one prompt's tokens, without start and end, at most `limit` of them.
    fn body(&self, prompt: &str, limit: usize) -> Vec<u32> {
        let mut ids = Vec::new();
        for piece in split_specials(prompt, &[START, END]) {
            if ids.len() >= limit {
                break;
            }
            match piece {
                Piece::Special(0) => ids.push(self.start),
                Piece::Special(_) => ids.push(self.end),
                Piece::Text(text) => {
                    for word in words(&normalize(text)) {
                        if ids.len() >= limit {
                            break;
                        }
                        self.bpe.encode_word(&byte_level(word), &mut ids);
                    }
                }
            }
        }
        ids.truncate(limit);
        ids
    }

    /// The ids `[P·context]` and mask `[P·context]` (1 = token) of `prompts`, row-major.
    pub fn encode(&self, prompts: &[impl AsRef<str>]) -> Result<(Vec<u32>, Vec<f32>)> {
        let mut ids = Vec::with_capacity(prompts.len() * self.context);
        let mut mask = Vec::with_capacity(prompts.len() * self.context);
        for (i, p) in prompts.iter().enumerate() {
            let p = p.as_ref();
            if p.len() > MAX_PROMPT_BYTES {
                return Err(Error::Input(format!("prompt {i} is {} bytes long; at most {MAX_PROMPT_BYTES} are read", p.len())));
            }
            let body = self.body(p, self.context - 2);
            let row: Vec<u32> = std::iter::once(self.start).chain(body).chain(std::iter::once(self.end)).collect();
            mask.extend(std::iter::repeat_n(1f32, row.len()).chain(std::iter::repeat_n(0f32, self.context - row.len())));
            let n = row.len();
            ids.extend(row);
            ids.extend(std::iter::repeat_n(self.end, self.context - n));
        }
        Ok((ids, mask))
    }

    /// The tokens per prompt.
    pub fn context(&self) -> usize {
        self.context
    }
}
