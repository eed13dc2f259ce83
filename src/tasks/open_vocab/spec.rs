//! How a run names its open-vocabulary classes and thresholds (`segment`'s flags, `annotate`'s
//! `[segmentation]` keys): a class file, inline prompts or a preset, each setting overriding the
//! preset's; without any, the prompts a GGUF stores, one class each.
use std::path::PathBuf;

use super::classes::ClassList;
use super::presets::{preset, preset_names};
use super::{Params, Slide};
use crate::error::{Error, Result};
use crate::weights::WeightStore;

/// The class list and thresholds as given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpenVocabSpec {
    /// A class file (one class per line, synonyms comma-separated).
    pub classes: Option<PathBuf>,
    /// Inline classes: `;` between classes, `,` between synonyms.
    pub prompts: Option<String>,
    /// A named SegEarth-OV-3 dataset setting.
    pub preset: Option<String>,
    /// Overrides `conf`.
    pub conf: Option<f32>,
    /// Overrides `prob_thd`.
    pub prob_thd: Option<f32>,
    /// Overrides `bg_idx`.
    pub bg_idx: Option<u8>,
    /// Overrides the sliding window (`Some(None)`: off).
    pub slide: Option<Option<Slide>>,
}

impl OpenVocabSpec {
    /// Whether it names classes (a class file, prompts or a preset).
    pub fn names_classes(&self) -> bool {
        self.classes.is_some() || self.prompts.is_some() || self.preset.is_some()
    }

    /// The classes and parameters; `store` is the model's (for the prompts it may store).
    pub fn resolve(&self, store: Option<&WeightStore>) -> Result<(ClassList, Params)> {
        let preset = match &self.preset {
            Some(name) => Some(preset(name).ok_or_else(|| Error::Config(format!("preset `{name}` is not one of {}", preset_names())))?),
            None => None,
        };
        let classes = match (&self.classes, &self.prompts, preset) {
            (Some(_), Some(_), _) => return Err(Error::Config("give a class file or prompts, not both".into())),
            (Some(file), None, _) => ClassList::read(file)?,
            (None, Some(p), _) => ClassList::parse_inline(p).map_err(|m| Error::Config(format!("prompts: {m}")))?,
            (None, None, Some(p)) => ClassList::parse_lines(p.classes).map_err(|m| Error::Config(format!("preset {}: {m}", p.name)))?,
            (None, None, None) => {
                let stored = match store {
                    Some(s) => crate::models::sam3::prompts::stored_prompt_names(s)?,
                    None => Vec::new(),
                };
                if stored.is_empty() {
                    return Err(Error::Config("a SAM 3 model needs its classes named: a class file, prompts or a preset (`--classes FILE`, `--prompts`, `--preset`; in annotate's [segmentation]: `classes`, `prompts`, `preset`)".into()));
                }
                ClassList::parse_lines(&stored.join("\n")).map_err(|m| Error::Config(format!("stored prompts: {m}")))?
            }
        };
        let mut params = preset.map(|p| p.params()).unwrap_or_default();
        params.conf = self.conf.unwrap_or(params.conf);
        params.prob_thd = self.prob_thd.unwrap_or(params.prob_thd);
        params.bg_idx = self.bg_idx.unwrap_or(params.bg_idx);
        params.slide = self.slide.unwrap_or(params.slide);
        params.validate(classes.len()).map_err(Error::Config)?;
        Ok((classes, params))
    }
}

/// Parses `CROP[:STRIDE]` (STRIDE defaults to CROP; a CROP of 0 turns the window off).
pub fn parse_slide(s: &str) -> std::result::Result<Option<Slide>, String> {
    let bad = || format!("`{s}` is not CROP[:STRIDE] in pixels");
    let num = |v: &str| v.trim().parse::<usize>().map_err(|_| bad());
    let (crop, stride) = match s.split_once(':') {
        Some((c, st)) => (num(c)?, Some(num(st)?)),
        None => (num(s)?, None),
    };
    Ok((crop > 0).then(|| Slide { crop, stride: stride.unwrap_or(crop) }))
}
