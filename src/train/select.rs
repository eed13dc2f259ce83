//! Which parameters train: `head` (everything after the backbone), `last:N` (also the backbone's
//! last N blocks and its final norm) or `all`.
use std::collections::BTreeSet;

use crate::error::{Error, Result};

/// The `train` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainSpec {
    /// The neck and head only; the backbone is frozen.
    Head,
    /// The head and the last N backbone blocks (with the backbone's final norm).
    Last(usize),
    /// Every parameter.
    All,
}

/// Largest N in `last:N`.
pub const MAX_LAST_BLOCKS: usize = 1024;

impl TrainSpec {
    /// Parses `head`, `all` or `last:N`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "head" => Ok(TrainSpec::Head),
            "all" => Ok(TrainSpec::All),
            _ => {
                let n = s
                    .strip_prefix("last:")
                    .and_then(|n| n.parse::<usize>().ok())
                    .filter(|n| (1..=MAX_LAST_BLOCKS).contains(n))
                    .ok_or_else(|| Error::Config(format!("train = `{s}`: expected `head`, `last:N` (N in 1..={MAX_LAST_BLOCKS}) or `all`")))?;
                Ok(TrainSpec::Last(n))
            }
        }
    }

    /// The canonical spelling.
    pub fn name(self) -> String {
        match self {
            TrainSpec::Head => "head".into(),
            TrainSpec::Last(n) => format!("last:{n}"),
            TrainSpec::All => "all".into(),
        }
    }
}

/// Where a family keeps its backbone and its backbone's numbered blocks.
#[derive(Debug, Clone, Copy)]
pub struct BackboneLayout {
    /// Prefix of every backbone tensor (`backbone.`).
    pub prefix: &'static str,
    /// Prefix of block `i`'s tensors, before the number (`backbone.encoder.layer.`).
    pub blocks: &'static str,
    /// Prefixes of the backbone's final norm, trained with its last block.
    pub final_norm: &'static [&'static str],
}

/// Depth Anything V1/V2 (transformers names).
pub const DEPTH_ANYTHING: BackboneLayout =
    BackboneLayout { prefix: "backbone.", blocks: "backbone.encoder.layer.", final_norm: &["backbone.layernorm."] };

/// The block number of `name` under `layout.blocks`, if any.
fn block_of(layout: &BackboneLayout, name: &str) -> Option<usize> {
    let rest = name.strip_prefix(layout.blocks)?;
    rest.split('.').next()?.parse().ok()
}

/// The set of tensor names `spec` trains among `names` (a checkpoint's tensors).
pub fn select(layout: &BackboneLayout, spec: TrainSpec, names: &[String]) -> Result<BTreeSet<String>> {
    let blocks = names.iter().filter_map(|n| block_of(layout, n)).max().map_or(0, |m| m + 1);
    let first_trained = match spec {
        TrainSpec::Head => blocks,
        TrainSpec::All => 0,
        TrainSpec::Last(n) if n > blocks => {
            return Err(Error::Config(format!("train = `last:{n}`, but the backbone has {blocks} blocks")));
        }
        TrainSpec::Last(n) => blocks - n,
    };
    let chosen: BTreeSet<String> = names
        .iter()
        .filter(|n| {
            spec == TrainSpec::All
                || !n.starts_with(layout.prefix)
                || block_of(layout, n).is_some_and(|b| b >= first_trained)
                || (first_trained < blocks && layout.final_norm.iter().any(|p| n.starts_with(p)))
        })
        .cloned()
        .collect();
    if chosen.is_empty() {
        return Err(Error::Config(format!("train = `{}` selects no parameter of this checkpoint", spec.name())));
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        ["backbone.embeddings.cls_token", "backbone.encoder.layer.0.norm1.weight", "backbone.encoder.layer.1.norm1.weight", "backbone.encoder.layer.10.mlp.fc1.weight", "backbone.layernorm.weight", "neck.convs.0.weight", "head.conv1.weight"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    #[test]
    fn head_last_and_all_pick_what_they_say() {
        let head = select(&DEPTH_ANYTHING, TrainSpec::Head, &names()).unwrap();
        assert_eq!(head.into_iter().collect::<Vec<_>>(), ["head.conv1.weight", "neck.convs.0.weight"]);
        let last = select(&DEPTH_ANYTHING, TrainSpec::Last(2), &names()).unwrap();
        assert!(last.contains("backbone.encoder.layer.10.mlp.fc1.weight") && last.contains("backbone.layernorm.weight"));
        assert!(!last.contains("backbone.encoder.layer.1.norm1.weight"), "block 1 of 11 is not among the last 2");
        assert_eq!(select(&DEPTH_ANYTHING, TrainSpec::All, &names()).unwrap().len(), names().len());
    }

    #[test]
    fn bad_specs_are_config_errors() {
        assert!(TrainSpec::parse("last:0").is_err());
        assert!(TrainSpec::parse("tail").is_err());
        assert!(select(&DEPTH_ANYTHING, TrainSpec::Last(12), &names()).is_err());
        let backbone_only = vec!["backbone.encoder.layer.0.norm1.weight".to_string()];
        assert!(select(&DEPTH_ANYTHING, TrainSpec::Head, &backbone_only).is_err());
    }
}
