//! Grounding as semantic segmentation reads it (SegEarth-OV-3's patched `_forward_grounding`): the
//! presence score, the queries whose score σ(logit)·presence exceeds a threshold with their mask
//! logits (only those are decoded), and the semantic map's logits.
use candle_core::{DType, Device, Tensor};

use super::{ImageFeatures, PromptFeatures, PromptSink, Sam3};
use crate::error::{Error, Result};

/// One prompt's maps at the ×4 FPN level.
#[derive(Debug, Clone, Default)]
pub struct PromptMaps {
    /// σ(presence logit).
    pub presence: f32,
    /// The kept queries' scores σ(logit)·presence, in query order.
    pub scores: Vec<f32>,
    /// The kept queries' mask logits: `scores.len()` planes of `size`, row-major.
    pub masks: Vec<f32>,
    /// The semantic map's logits: one plane of `size`.
    pub semantic: Vec<f32>,
    /// `(rows, columns)` of a plane.
    pub size: (usize, usize),
}

/// The logistic function, in f32 as PyTorch's `sigmoid`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// A tensor's values as f32 on the CPU.
fn values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Collects each prompt's maps and hands them on once its semantic map is made.
struct MapsSink<'a> {
    confidence: f32,
    device: Device,
    current: PromptMaps,
    each: &'a mut dyn FnMut(usize, PromptMaps) -> Result<()>,
}

impl PromptSink for MapsSink<'_> {
    fn select(&mut self, logits: &Tensor, presence: &Tensor) -> Result<Option<Tensor>> {
        let presence = *values(presence)?.first().ok_or_else(|| Error::Input("an empty presence logit".into()))?;
        let presence = sigmoid(presence);
        let mut kept = Vec::new();
        self.current = PromptMaps { presence, ..PromptMaps::default() };
        for (i, l) in values(logits)?.into_iter().enumerate() {
            let score = sigmoid(l) * presence;
            if score > self.confidence {
                kept.push(i as u32);
                self.current.scores.push(score);
            }
        }
        let k = kept.len();
        Ok(Some(Tensor::from_vec(kept, k, &self.device)?))
    }

    fn emit(&mut self, name: &str, row: usize, t: &Tensor) -> Result<()> {
        match name {
            "pred_masks" => self.current.masks = values(t)?,
            "semantic_seg" => {
                let (_, _, h, w) = t.dims4()?;
                self.current.semantic = values(t)?;
                self.current.size = (h, w);
                (self.each)(row, std::mem::take(&mut self.current))?;
            }
            _ => {}
        }
        Ok(())
    }
}

impl Sam3 {
    /// Grounds `prompts` in one image, handing `each(prompt index, maps)` every prompt's maps in
    /// order, with mask logits only for the queries scoring above `confidence` (strictly).
    pub fn ground_maps(&self, image: &ImageFeatures, prompts: &PromptFeatures, confidence: f32, each: &mut dyn FnMut(usize, PromptMaps) -> Result<()>) -> Result<()> {
        if prompts.is_empty() {
            return Err(Error::Input("no prompts to ground".into()));
        }
        let device = self.pos.device().clone();
        self.ground_each(image, prompts, &mut MapsSink { confidence, device, current: PromptMaps::default(), each })
    }
}
