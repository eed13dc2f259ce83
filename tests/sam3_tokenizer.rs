//! SAM 3's CLIP tokenizer against transformers' `CLIPTokenizer` on 225 strings (Unicode, punctuation,
//! digits, contractions, special-token text, over-long, empty; tools/fixtures/clip_tokenizer.py), read
//! from each form a checkpoint may carry its vocabulary in, and hostile tokenizer files refused.
mod common;

use std::collections::BTreeMap;

use common::fixture;
use edgerun::models::sam3::tokenizer::{BpeVocabulary, ClipTokenizer};

const CONTEXT: usize = 32;
const VOCAB: usize = 49408;

struct Case {
    text: String,
    ids: Vec<u32>,
    mask: Vec<f32>,
}

fn cases() -> Vec<Case> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture("clip_tokenizer").join("cases.json")).unwrap()).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().to_string(),
            ids: c["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
            mask: c["attention_mask"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect(),
        })
        .collect()
}

fn check(tok: &ClipTokenizer, how: &str) {
    let cases = cases();
    assert!(cases.len() >= 200);
    let texts: Vec<&str> = cases.iter().map(|c| c.text.as_str()).collect();
    let (ids, mask) = tok.encode(&texts).unwrap();
    for (i, c) in cases.iter().enumerate() {
        assert_eq!(&ids[i * CONTEXT..(i + 1) * CONTEXT], c.ids.as_slice(), "{how}: ids of {:?}", c.text);
        assert_eq!(&mask[i * CONTEXT..(i + 1) * CONTEXT], c.mask.as_slice(), "{how}: mask of {:?}", c.text);
    }
}

#[test]
fn equals_transformers_from_tokenizer_json() {
    let v = BpeVocabulary::from_tokenizer_json(&fixture("clip_tokenizer").join("tokenizer.json")).unwrap();
    check(&ClipTokenizer::new(&v, CONTEXT, VOCAB).unwrap(), "tokenizer.json");
}

#[test]
fn equals_transformers_from_vocab_and_merges_and_through_gguf_metadata() {
    let dir = fixture("clip_tokenizer");
    let v = BpeVocabulary::from_vocab_merges(&dir.join("vocab.json"), &dir.join("merges.txt")).unwrap();
    assert_eq!(v, BpeVocabulary::from_tokenizer_json(&dir.join("tokenizer.json")).unwrap(), "the two file forms read alike");
    check(&ClipTokenizer::new(&v, CONTEXT, VOCAB).unwrap(), "vocab.json + merges.txt");
    let meta: BTreeMap<_, _> = v.metadata().into_iter().collect();
    let back = BpeVocabulary::from_metadata(&meta).unwrap().unwrap();
    assert_eq!(back, v);
}

fn write(dir: &std::path::Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn hostile_tokenizer_files_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let json = |body: &str| write(d, "tokenizer.json", body);
    for (body, want) in [
        ("{", "invalid JSON"),
        (r#"{"model": {"type": "WordPiece", "vocab": {}}}"#, "WordPiece"),
        (r#"{"model": {"type": "BPE", "vocab": [1, 2], "merges": []}}"#, "vocab"),
        (r#"{"model": {"type": "BPE", "vocab": {"a": -1}, "merges": []}}"#, "not a whole number"),
        (r#"{"model": {"type": "BPE", "vocab": {"a": 5000000000}, "merges": []}}"#, "beyond u32"),
        (r#"{"model": {"type": "BPE", "vocab": {"a": 1, "b": 1}, "merges": []}}"#, "two tokens"),
        (r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a"]}}"#, "not two symbols"),
        (r#"{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [[1, 2]]}}"#, "pair of strings"),
    ] {
        let err = BpeVocabulary::from_tokenizer_json(&json(body)).expect_err(body).to_string();
        assert!(err.contains("tokenizer.json") && err.contains(want), "{body}: {err}");
    }
    // Parses, but does not fit the model: an id past the text encoder, a missing special token, a merge of unknown symbols.
    let build = |body: &str| BpeVocabulary::from_tokenizer_json(&json(body)).and_then(|v| ClipTokenizer::new(&v, CONTEXT, VOCAB)).map(|_| ());
    let specials = r#""<|startoftext|>": 1, "<|endoftext|>": 2"#;
    for (body, want) in [
        (format!(r#"{{"model": {{"vocab": {{{specials}, "a": 60000}}, "merges": []}}}}"#), "beyond the text encoder"),
        (r#"{"model": {"vocab": {"a": 0}, "merges": []}}"#.to_string(), "<|startoftext|>"),
        (format!(r#"{{"model": {{"vocab": {{{specials}, "a": 0}}, "merges": ["x y"]}}}}"#), "tokenizer"),
    ] {
        let err = build(&body).expect_err(&body).to_string();
        assert!(err.contains(want), "{body}: {err}");
    }
    // Oversized: refused before it is read whole.
    let big = d.join("big.json");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(64 << 20).unwrap();
    let err = BpeVocabulary::from_tokenizer_json(&big).expect_err("64 MiB").to_string();
    assert!(err.contains("big.json"), "{err}");
    // merges.txt lines that are not pairs.
    let vocab = write(d, "vocab.json", r#"{"a": 0, "b": 1}"#);
    let merges = write(d, "merges.txt", "#version: 0.2\na b\nab c d\n");
    let err = BpeVocabulary::from_vocab_merges(&vocab, &merges).expect_err("3 symbols").to_string();
    assert!(err.contains("merges.txt") && err.contains("line 3"), "{err}");
}

#[test]
fn prompts_past_the_context_are_cut_and_huge_ones_refused() {
    let v = BpeVocabulary::from_tokenizer_json(&fixture("clip_tokenizer").join("tokenizer.json")).unwrap();
    let tok = ClipTokenizer::new(&v, CONTEXT, VOCAB).unwrap();
    let (ids, mask) = tok.encode(&["tree ".repeat(100)]).unwrap();
    assert_eq!(ids.len(), CONTEXT);
    assert_eq!(ids[CONTEXT - 1], 49407, "the end token is kept when cut");
    assert!(mask.iter().all(|&m| m == 1.0));
    assert!(tok.encode(&["x".repeat(1 << 17)]).is_err());
}
