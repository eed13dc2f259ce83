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

/// Where a backbone tensor sits in the forward order of its stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Slot {
    /// The stage's embedding (patch embedding, position embedding, tokens).
    Embed,
    /// Block `j` of the stage.
    Block(usize),
    /// The stage's final norm.
    Norm,
}

/// A backbone tensor's place: (stage, slot), ordered as the forward pass runs.
pub type Position = (usize, Slot);

/// How a family names its backbone: the prefix of every backbone tensor and where each one sits.
#[derive(Debug, Clone, Copy)]
pub struct BackboneLayout {
    /// Prefix of every backbone tensor (`backbone.`).
    pub prefix: &'static str,
    /// The position of a backbone tensor (None: not part of the forward order, e.g. unused tokens).
    pub position: fn(&str) -> Option<Position>,
}

/// The number after `prefix` in `name` (`backbone.layer.` + `3.mlp…` → 3).
fn number_after(name: &str, prefix: &str) -> Option<usize> {
    name.strip_prefix(prefix)?.split('.').next()?.parse().ok()
}

/// Two numbers after `prefix` (`block.` + `2.1.attn…` → (2, 1)).
fn two_numbers_after(name: &str, prefix: &str) -> Option<(usize, usize)> {
    let mut it = name.strip_prefix(prefix)?.split('.');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// A single-stage ViT: embeddings, numbered blocks, a final norm.
fn vit_position(name: &str, embed: &str, blocks: &str, norm: &str) -> Option<Position> {
    if name.starts_with(embed) {
        Some((0, Slot::Embed))
    } else if let Some(i) = number_after(name, blocks) {
        Some((0, Slot::Block(i)))
    } else if name.starts_with(norm) {
        Some((0, Slot::Norm))
    } else {
        None
    }
}

/// Depth Anything V1/V2 (transformers names, DINOv2 backbone).
pub const DEPTH_ANYTHING: BackboneLayout = BackboneLayout {
    prefix: "backbone.",
    position: |n| vit_position(n, "backbone.embeddings.", "backbone.encoder.layer.", "backbone.layernorm."),
};

/// CHMv2 (transformers names, DINOv3 backbone).
pub const CHMV2: BackboneLayout =
    BackboneLayout { prefix: "backbone.", position: |n| vit_position(n, "backbone.embeddings.", "backbone.layer.", "backbone.norm.") };

/// SegFormer (transformers names): four stages of patch embedding, blocks and norm.
pub const SEGFORMER: BackboneLayout = BackboneLayout {
    prefix: "segformer.",
    position: |n| {
        if let Some(s) = number_after(n, "segformer.encoder.patch_embeddings.") {
            Some((s, Slot::Embed))
        } else if let Some((s, j)) = two_numbers_after(n, "segformer.encoder.block.") {
            Some((s, Slot::Block(j)))
        } else {
            number_after(n, "segformer.encoder.layer_norm.").map(|s| (s, Slot::Norm))
        }
    },
};

/// Buffers that never train (BatchNorm statistics).
fn is_buffer(name: &str) -> bool {
    ["running_mean", "running_var", "num_batches_tracked"].iter().any(|b| name.ends_with(b))
}

/// The backbone blocks of a checkpoint, in forward order.
pub fn blocks(layout: &BackboneLayout, names: &[String]) -> Vec<Position> {
    let set: BTreeSet<Position> =
        names.iter().filter_map(|n| (layout.position)(n)).filter(|(_, s)| matches!(s, Slot::Block(_))).collect();
    set.into_iter().collect()
}

/// The set of tensor names `spec` trains among `names` (a checkpoint's tensors): the head always;
/// for `last:N` the last N backbone blocks and everything after them in the forward order (later
/// stages' embeddings, the norms); for `all` everything. BatchNorm statistics never train.
pub fn select(layout: &BackboneLayout, spec: TrainSpec, names: &[String]) -> Result<BTreeSet<String>> {
    let blocks = blocks(layout, names);
    let first_trained: Option<Position> = match spec {
        TrainSpec::Head => None,
        TrainSpec::All => Some((0, Slot::Embed)),
        TrainSpec::Last(n) if n > blocks.len() => {
            return Err(Error::Config(format!("train = `last:{n}`, but the backbone has {} blocks", blocks.len())));
        }
        TrainSpec::Last(n) => Some(blocks[blocks.len() - n]),
    };
    let chosen: BTreeSet<String> = names
        .iter()
        .filter(|n| !is_buffer(n))
        .filter(|n| {
            spec == TrainSpec::All
                || !n.starts_with(layout.prefix)
                || first_trained.is_some_and(|f| (layout.position)(n).is_some_and(|p| p >= f))
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
        let last = select(&DEPTH_ANYTHING, TrainSpec::Last(1), &names()).unwrap();
        assert!(last.contains("backbone.encoder.layer.10.mlp.fc1.weight") && last.contains("backbone.layernorm.weight"));
        assert!(!last.contains("backbone.encoder.layer.1.norm1.weight"), "block 1 is not the last block (10 is)");
        assert!(!last.contains("backbone.embeddings.cls_token"));
        let last2 = select(&DEPTH_ANYTHING, TrainSpec::Last(2), &names()).unwrap();
        assert!(last2.contains("backbone.encoder.layer.1.norm1.weight") && !last2.contains("backbone.encoder.layer.0.norm1.weight"), "blocks are counted as the checkpoint has them");
        assert_eq!(select(&DEPTH_ANYTHING, TrainSpec::All, &names()).unwrap().len(), names().len());
    }

    #[test]
    fn segformer_last_blocks_follow_the_stage_order() {
        let names: Vec<String> = [
            "segformer.encoder.patch_embeddings.2.proj.weight",
            "segformer.encoder.block.2.1.mlp.dense1.weight",
            "segformer.encoder.layer_norm.2.weight",
            "segformer.encoder.patch_embeddings.3.proj.weight",
            "segformer.encoder.block.3.0.mlp.dense1.weight",
            "segformer.encoder.block.3.1.mlp.dense1.weight",
            "segformer.encoder.layer_norm.3.weight",
            "decode_head.batch_norm.weight",
            "decode_head.batch_norm.running_mean",
            "decode_head.batch_norm.num_batches_tracked",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let last2 = select(&SEGFORMER, TrainSpec::Last(2), &names).unwrap();
        let want = ["decode_head.batch_norm.weight", "segformer.encoder.block.3.0.mlp.dense1.weight", "segformer.encoder.block.3.1.mlp.dense1.weight", "segformer.encoder.layer_norm.3.weight"];
        assert_eq!(last2.iter().map(String::as_str).collect::<Vec<_>>(), want, "stage 3's embedding precedes its blocks");
        let last3 = select(&SEGFORMER, TrainSpec::Last(3), &names).unwrap();
        assert!(last3.contains("segformer.encoder.patch_embeddings.3.proj.weight") && last3.contains("segformer.encoder.layer_norm.2.weight"));
        assert!(!last3.contains("segformer.encoder.patch_embeddings.2.proj.weight"));
        let all = select(&SEGFORMER, TrainSpec::All, &names).unwrap();
        assert!(!all.iter().any(|n| n.contains("running_mean") || n.contains("num_batches")), "BatchNorm statistics never train");
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
