//! Which parameters train: `head` (everything after the backbone), `last:N` (also the backbone's
//! last N blocks and its final norm) or `all`.
use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::models::training::{Position, Slot, TrainingLayout};

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
pub(crate) const MAX_LAST_BLOCKS: usize = 1024;

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

impl std::str::FromStr for TrainSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        TrainSpec::parse(s).map_err(|e| e.to_string().trim_start_matches("config: ").to_string())
    }
}

impl<'de> serde::Deserialize<'de> for TrainSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for TrainSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

/// Buffers that never train (BatchNorm statistics).
fn is_buffer(name: &str) -> bool {
    ["running_mean", "running_var", "num_batches_tracked"].iter().any(|b| name.ends_with(b))
}

/// The backbone blocks of a checkpoint, in forward order.
pub fn blocks(layout: &TrainingLayout, names: &[String]) -> Vec<Position> {
    let set: BTreeSet<Position> =
        names.iter().filter_map(|n| (layout.position)(n)).filter(|(_, s)| matches!(s, Slot::Block(_))).collect();
    set.into_iter().collect()
}

/// The set of tensor names `spec` trains among `names` (a checkpoint's tensors): the head always;
/// for `last:N` the last N backbone blocks and everything after them in the forward order (later
/// stages' embeddings, the norms); for `all` everything. BatchNorm statistics never train.
pub fn select(layout: &TrainingLayout, spec: TrainSpec, names: &[String]) -> Result<BTreeSet<String>> {
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
    use crate::models::depth_anything::DepthAnythingFamily;
    use crate::models::family::Family;
    use crate::models::segformer::SegformerFamily;

    const DEPTH_ANYTHING: TrainingLayout = DepthAnythingFamily::TRAINING.unwrap();
    const SEGFORMER: TrainingLayout = SegformerFamily::TRAINING.unwrap();

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
