//! SAM 3's image path (`Sam3Model`, transformers 5.24; the original `sam3` 0.1.4 `Sam3Image`
//! grounding): the Perception Encoder ViT and FPN neck once per image, the CLIP text encoder once per
//! prompt, then per prompt the DETR encoder and decoder, the dot-product scoring, the presence logit
//! and the mask decoder. Where the two references differ edgerun follows the original by default
//! ([`Sam3Path`]; docs/sam3.md). Module paths are the hub's (transformers) tensor names; the
//! `facebook/sam3` checkpoint's `detector_model.` prefix is found and its tracker ignored.
mod attention;
mod bpe;
mod clip_text;
pub mod config;
mod detr_decoder;
mod detr_encoder;
mod family;
mod geometry;
mod heads;
mod neck;
pub mod prompts;
mod semantic;
mod text;
pub mod tokenizer;
mod unicode_classes;
mod vit;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::profile::Span;
use crate::models::{required, Model, NamedTensors};
use crate::tensor_io::{CollectSink, OutputSink};
use crate::weights::Vb;
pub use config::Config;
pub use family::Sam3Family;
pub use semantic::{sigmoid, PromptMaps};
use attention::padding_bias;
use detr_decoder::DetrDecoder;
use detr_encoder::DetrEncoder;
use geometry::EmptyGeometry;
use heads::{cxcywh_to_xyxy, MaskDecoder, Scoring};
use neck::{grid_sine_tensor, Neck, LEVELS};
use prompts::StoredPrompts;
use text::TextEncoder;
use tokenizer::ClipTokenizer;
use vit::Vit;

/// The prefix of the detector's tensors in the hub checkpoint (`Sam3VideoModel`).
const DETECTOR_PREFIX: &str = "detector_model";
/// The most prompts that go through the DETR encoder in one batch (its transients grow with it:
/// 4 keeps a Q8_0 pass with stored prompts under 1.2 GiB; 8 saved no measurable time).
const PROMPT_BATCH: usize = 4;

/// Which reference's grounding path to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sam3Path {
    /// The original `sam3` package (what SegEarth-OV-3 runs): the ViT's LayerNorms use eps 1e-5, and
    /// the geometry encoder always encodes an empty prompt, whose one token joins every prompt.
    #[default]
    Original,
    /// transformers' `Sam3Model` without box prompts: the config's LayerNorm eps, the text tokens alone.
    Transformers,
}

/// What a prompt brings to the image side: the projected text features and their mask.
#[derive(Debug, Clone)]
pub struct PromptFeatures {
    /// `[P, L, D]`.
    pub features: Tensor,
    /// `[P, L]`, 1 for a token, 0 for padding.
    pub mask: Tensor,
}

impl PromptFeatures {
    /// The number of prompts.
    pub fn len(&self) -> usize {
        self.features.dim(0).unwrap_or(0)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Prompts `start..start + len`.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Self> {
        Ok(PromptFeatures { features: self.features.narrow(0, start, len)?, mask: self.mask.narrow(0, start, len)? })
    }
}

/// What the image side computes once per image.
#[derive(Debug, Clone)]
pub struct ImageFeatures {
    /// The FPN levels `[1, D, ·, ·]`, finest (×4) first.
    pub levels: Vec<Tensor>,
    /// The ×1 level as tokens, `[1, N, D]`.
    tokens: Tensor,
    /// The empty geometry prompt's token `[1, 1, D]` ([`Sam3Path::Original`]).
    geometry: Option<Tensor>,
}

/// The grounding outputs for one image and some prompts.
#[derive(Debug, Clone)]
pub struct Grounding {
    /// Instance mask logits `[P, Q, H/4·…]` at the ×4 FPN level.
    pub pred_masks: Tensor,
    /// Boxes `(x0, y0, x1, y1)` in 0..1, `[P, Q, 4]`.
    pub pred_boxes: Tensor,
    /// Query logits `[P, Q]`.
    pub pred_logits: Tensor,
    /// The presence logit `[P, 1]`.
    pub presence_logits: Tensor,
    /// The semantic map logits `[P, 1, ·, ·]`.
    pub semantic_seg: Tensor,
}

/// The grounding outputs' names, as the references name them.
const GROUNDING_OUTPUTS: [&str; 5] = ["pred_masks", "pred_boxes", "pred_logits", "presence_logits", "semantic_seg"];

impl Grounding {
    /// The output called `name` (one of [`GROUNDING_OUTPUTS`]).
    fn output(&self, name: &str) -> Result<&Tensor> {
        Ok(match name {
            "pred_masks" => &self.pred_masks,
            "pred_boxes" => &self.pred_boxes,
            "pred_logits" => &self.pred_logits,
            "presence_logits" => &self.presence_logits,
            "semantic_seg" => &self.semantic_seg,
            _ => return Err(Error::Input(format!("no grounding output `{name}`"))),
        })
    }
}

/// Where grounding hands each prompt's outputs, and which of its queries get instance masks.
trait PromptSink {
    /// The queries (u32 indices `[K]`) whose masks to make, from the prompt's query logits `[1, Q]`
    /// and presence logit `[1, 1]`; `None`: every query.
    fn select(&mut self, _logits: &Tensor, _presence: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// Takes one prompt's output `(name, prompt index, [1, …])` (names as [`Grounding`]'s fields;
    /// `pred_masks` holds the selected queries' masks and is not handed over when none is).
    fn emit(&mut self, name: &str, row: usize, t: &Tensor) -> Result<()>;
}

/// Every query's outputs, each handed to a closure.
struct AllQueries<F>(F);

impl<F: FnMut(&str, usize, &Tensor) -> Result<()>> PromptSink for AllQueries<F> {
    fn emit(&mut self, name: &str, row: usize, t: &Tensor) -> Result<()> {
        (self.0)(name, row, t)
    }
}

/// SAM 3 for grounding text prompts in images.
pub struct Sam3 {
    vit: Vit,
    neck: Neck,
    text: Option<TextEncoder>,
    geometry: Option<EmptyGeometry>,
    detr_encoder: DetrEncoder,
    detr_decoder: DetrDecoder,
    scoring: Scoring,
    mask_decoder: MaskDecoder,
    /// The ×1 level's sine positions `[1, N, D]`.
    pos: Tensor,
    tokenizer: Option<ClipTokenizer>,
    stored: Option<StoredPrompts>,
    config: Config,
    path: Sam3Path,
}

impl Sam3 {
    /// Loads the model under `vb` (the checkpoint root; a `detector_model.` prefix is found) on the
    /// original's path.
    pub fn load(vb: &Vb, config: &Config) -> Result<Self> {
        Self::load_with(vb, config, Sam3Path::Original)
    }

    /// Loads the model on the chosen reference's path.
    pub fn load_with(vb: &Vb, config: &Config, path: Sam3Path) -> Result<Self> {
        let _span = Span::new("sam3.load");
        let stored = StoredPrompts::load(vb, config.text_config.max_position_embeddings, config.width())?;
        let tokenizer = prompts::tokenizer(vb.store(), vb.store().root(), config)?;
        let vb = detector_root(vb);
        let vit_config = config.vit();
        let eps = match path {
            Sam3Path::Original => geometry::EPS,
            Sam3Path::Transformers => vit_config.layer_norm_eps,
        };
        let d = config.width();
        let ve = vb.pp("vision_encoder");
        let vit = Vit::load(&ve.pp("backbone"), vit_config, eps)?;
        let neck = Neck::load(&ve.pp("neck"), vit_config.hidden_size, d)?;
        let text = if vb.contains("text_encoder.text_model.embeddings.token_embedding.weight") { Some(TextEncoder::load(&vb, &config.text_config, d)?) } else { None };
        let geometry = match path {
            Sam3Path::Original => Some(EmptyGeometry::load(&vb.pp("geometry_encoder"), &config.geometry_encoder_config)?),
            Sam3Path::Transformers => None,
        };
        let g = vit.grid();
        Ok(Sam3 {
            vit,
            neck,
            text,
            geometry,
            detr_encoder: DetrEncoder::load(&vb.pp("detr_encoder"), &config.detr_encoder_config)?,
            detr_decoder: DetrDecoder::load(&vb.pp("detr_decoder"), &config.detr_decoder_config)?,
            scoring: Scoring::load(&vb.pp("dot_product_scoring"), config)?,
            mask_decoder: MaskDecoder::load(&vb.pp("mask_decoder"), config, LEVELS)?,
            pos: grid_sine_tensor(g, g, d / 2, vb.dtype(), vb.device())?,
            tokenizer,
            stored,
            config: config.clone(),
            path,
        })
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Which reference's path it runs.
    pub fn path(&self) -> Sam3Path {
        self.path
    }

    /// Whether it carries its text encoder.
    pub fn has_text_encoder(&self) -> bool {
        self.text.is_some()
    }

    /// The prompts whose features the file stores.
    pub fn stored_prompts(&self) -> &[String] {
        self.stored.as_ref().map(|s| s.names.as_slice()).unwrap_or_default()
    }

    /// The features of `prompts`: stored ones as stored, the others from the tokenizer and the text
    /// encoder (all of them in one batch). Compute them once and ground them in every image.
    pub fn prompt_features(&self, prompts: &[impl AsRef<str>]) -> Result<PromptFeatures> {
        if prompts.is_empty() || prompts.len() > prompts::MAX_PROMPTS {
            return Err(Error::Input(format!("{} prompts; 1 to {} are grounded at once", prompts.len(), prompts::MAX_PROMPTS)));
        }
        let rows: Vec<Option<usize>> = prompts.iter().map(|p| self.stored.as_ref().and_then(|s| s.row(p.as_ref()))).collect();
        let new: Vec<&str> = prompts.iter().zip(&rows).filter(|(_, r)| r.is_none()).map(|(p, _)| p.as_ref()).collect();
        let computed = if new.is_empty() {
            None
        } else {
            let tok = match (&self.tokenizer, &self.text) {
                (Some(t), Some(_)) => t,
                (_, None) => {
                    return Err(Error::Input(format!(
                        "prompt {:?} is not among the {} this file stores ({}) and it has no text encoder to compute it",
                        new[0],
                        self.stored_prompts().len(),
                        self.stored_prompts().join(", ")
                    )))
                }
                (None, Some(_)) => return Err(Error::Input("no tokenizer beside the model (tokenizer.json, or vocab.json and merges.txt) to tokenize the prompts".into())),
            };
            let (ids, mask) = tok.encode(&new)?;
            let shape = (new.len(), tok.context());
            let dev = self.pos.device();
            Some(self.prompt_features_from_ids(&Tensor::from_vec(ids, shape, dev)?, &Tensor::from_vec(mask, shape, dev)?)?)
        };
        let mut next_new = 0;
        let mut features = Vec::with_capacity(prompts.len());
        let mut masks = Vec::with_capacity(prompts.len());
        for r in rows {
            let (src, i) = match (r, &self.stored, &computed) {
                (Some(i), Some(s), _) => (&s.features, i),
                (None, _, Some(c)) => {
                    next_new += 1;
                    (c, next_new - 1)
                }
                _ => return Err(Error::Input("a prompt's features went missing".into())),
            };
            features.push(src.features.narrow(0, i, 1)?.to_dtype(self.pos.dtype())?);
            masks.push(src.mask.narrow(0, i, 1)?);
        }
        Ok(PromptFeatures { features: Tensor::cat(&features, 0)?, mask: Tensor::cat(&masks, 0)? })
    }

    /// The image side of one image, `pixel_values` `[1, C, S, S]`.
    pub fn image_features(&self, pixel_values: &Tensor) -> Result<ImageFeatures> {
        if pixel_values.dim(0)? != 1 {
            return Err(Error::Input(format!("image_features takes one image, got pixel_values {:?}", pixel_values.dims())));
        }
        let span = Span::new("sam3.vit");
        let tokens = self.vit.forward(&pixel_values.to_dtype(self.pos.dtype())?)?;
        drop(span);
        let span = Span::new("sam3.neck");
        let (b, n, c) = tokens.dims3()?;
        let g = self.vit.grid();
        let map = tokens.transpose(1, 2)?.reshape((b, c, g, g))?;
        let levels = self.neck.forward(&map)?;
        let tokens = levels[LEVELS - 1].flatten_from(2)?.transpose(1, 2)?.contiguous()?;
        debug_assert_eq!(tokens.dim(1)?, n);
        drop(span);
        let _span = Span::new("sam3.geometry");
        let geometry = match &self.geometry {
            Some(geo) => Some(geo.forward(&tokens, &self.pos)?),
            None => None,
        };
        Ok(ImageFeatures { levels, tokens, geometry })
    }

    /// The prompt features of token ids `[P, L]` (u32) under `mask` `[P, L]`, by the text encoder.
    pub fn prompt_features_from_ids(&self, ids: &Tensor, mask: &Tensor) -> Result<PromptFeatures> {
        let text = self.text.as_ref().ok_or_else(|| Error::Input("this SAM 3 file carries no text encoder (its prompts were stored by `edgerun quantize --prompts`)".into()))?;
        if ids.dims() != mask.dims() {
            return Err(Error::Input(format!("input_ids {:?} and attention_mask {:?} differ in shape", ids.dims(), mask.dims())));
        }
        let _span = Span::new("sam3.text");
        let features = text.forward(ids, mask)?;
        Ok(PromptFeatures { features, mask: mask.to_dtype(DType::F32)? })
    }

    /// Grounds `prompts` in one image: the DETR encoder over batches of prompts, then per prompt the
    /// decoder, the scores, boxes and presence and the masks, written into the outputs in place (the
    /// masks of many prompts are the largest thing a pass holds).
    pub fn ground(&self, image: &ImageFeatures, prompts: &PromptFeatures) -> Result<Grounding> {
        let p = prompts.len();
        if p == 0 {
            return Err(Error::Input("no prompts to ground".into()));
        }
        let dtype = self.pos.dtype();
        let dev = self.pos.device();
        let (q, (mh, mw)) = (self.config.detr_decoder_config.num_queries, image.levels[0].dims4().map(|d| (d.2, d.3))?);
        let out = Grounding {
            pred_masks: Tensor::zeros((p, q, mh, mw), dtype, dev)?,
            pred_boxes: Tensor::zeros((p, q, 4), dtype, dev)?,
            pred_logits: Tensor::zeros((p, q), dtype, dev)?,
            presence_logits: Tensor::zeros((p, 1), dtype, dev)?,
            semantic_seg: Tensor::zeros((p, 1, mh, mw), dtype, dev)?,
        };
        self.ground_each(image, prompts, &mut AllQueries(|name: &str, row, t: &Tensor| Ok(out.output(name)?.slice_set(&t.contiguous()?, 0, row)?)))?;
        Ok(out)
    }

    /// Grounds `prompts` in one image, handing each prompt's outputs to `sink` as they are made.
    fn ground_each(&self, image: &ImageFeatures, prompts: &PromptFeatures, sink: &mut dyn PromptSink) -> Result<()> {
        let p = prompts.len();
        let mut start = 0;
        while start < p {
            let len = PROMPT_BATCH.min(p - start);
            self.ground_batch(image, &prompts.narrow(start, len)?, start, sink)?;
            start += len;
        }
        Ok(())
    }

    /// Grounds a batch of prompts, handing their outputs to `sink` as prompts `at..`.
    fn ground_batch(&self, image: &ImageFeatures, prompts: &PromptFeatures, at: usize, sink: &mut dyn PromptSink) -> Result<()> {
        let dtype = self.pos.dtype();
        let p = prompts.len();
        let d = self.config.width();
        let (features, mask) = (prompts.features.to_dtype(dtype)?, prompts.mask.to_dtype(DType::F32)?);
        if features.dim(2)? != d {
            return Err(Error::Input(format!("prompt features {:?} are not {d} wide", features.dims())));
        }
        let (prompt, mask) = match &image.geometry {
            Some(g) => (
                Tensor::cat(&[&features, &g.broadcast_as((p, 1, d))?.to_dtype(dtype)?], 1)?,
                Tensor::cat(&[&mask, &Tensor::ones((p, 1), DType::F32, mask.device())?], 1)?,
            ),
            None => (features, mask),
        };
        let bias = padding_bias(&mask, dtype)?;
        let g = self.vit.grid();
        let span = Span::new("sam3.detr_encoder");
        let memory = self.detr_encoder.forward(&image.tokens, &self.pos, &prompt, &bias)?;
        drop(span);
        // One prompt at a time from here: the decoder's box bias over the image tokens and the pixel
        // decoder's maps at the ×4 level are the largest transients, and they are per prompt.
        for i in 0..p {
            let (memory, prompt, mask, bias) = (memory.narrow(0, i, 1)?, prompt.narrow(0, i, 1)?, mask.narrow(0, i, 1)?, bias.narrow(0, i, 1)?);
            let span = Span::new("sam3.detr_decoder");
            let decoded = self.detr_decoder.forward(&memory, &self.pos, (g, g), &prompt, &bias)?;
            drop(span);
            let logits = self.scoring.logits(&decoded.queries, &self.scoring.prompt_vector(&prompt, &mask)?)?;
            sink.emit("pred_logits", at + i, &logits)?;
            sink.emit("pred_boxes", at + i, &cxcywh_to_xyxy(&decoded.boxes)?)?;
            sink.emit("presence_logits", at + i, &decoded.presence)?;
            let keep = sink.select(&logits, &decoded.presence)?;
            let _span = Span::new("sam3.mask_decoder");
            let m = self.mask_decoder.forward(&decoded.queries, &memory, (g, g), &image.levels[..LEVELS - 1], (&prompt, &bias), keep.as_ref())?;
            if let Some(instances) = &m.instances {
                sink.emit("pred_masks", at + i, instances)?;
            }
            sink.emit("semantic_seg", at + i, &m.semantic)?;
        }
        Ok(())
    }

    /// The ×1 level's sine positions as a map `[1, D, g, g]`.
    fn position_map(&self) -> Result<Tensor> {
        let g = self.vit.grid();
        let d = self.config.width();
        Ok(self.pos.transpose(1, 2)?.reshape((1, d, g, g))?)
    }
}

/// `vb` at the detector's tensors: the hub checkpoint's `detector_model.` prefix when it has one.
pub(crate) fn detector_root(vb: &Vb) -> Vb {
    if vb.contains(&format!("{DETECTOR_PREFIX}.vision_encoder.backbone.embeddings.position_embeddings")) {
        vb.pp(DETECTOR_PREFIX)
    } else {
        vb.clone()
    }
}

/// Token ids given as floats (as the fixtures store them): whole, non-negative, below 2³².
fn ids_from(t: &Tensor, name: &str) -> Result<Tensor> {
    let v = t.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f64>()?;
    if let Some(bad) = v.iter().find(|x| !(x.is_finite() && **x >= 0.0 && x.fract() == 0.0 && **x < u32::MAX as f64)) {
        return Err(Error::Input(format!("`{name}` holds {bad}, not a token id")));
    }
    Ok(Tensor::from_vec(v.iter().map(|&x| x as u32).collect::<Vec<_>>(), t.shape(), t.device())?)
}

impl Model for Sam3 {
    fn architecture(&self) -> &str {
        "sam3"
    }

    fn input_names(&self) -> Vec<&'static str> {
        vec!["pixel_values", "input_ids", "attention_mask"]
    }

    /// `pixel_values` `[B, C, S, S]` and prompts `input_ids` / `attention_mask` `[P, L]`: every image
    /// with every prompt, outputs image-major (`[B·P, …]`), plus the FPN levels, the ×1 level's
    /// positions and the prompts' text features.
    fn forward_named(&self, inputs: &NamedTensors) -> Result<NamedTensors> {
        let mut sink = CollectSink::on(self.pos.device());
        self.forward_into(inputs, &mut sink)?;
        sink.into_tensors()
    }

    /// [`Model::forward_named`]'s outputs, each prompt's written as soon as it is made: a pass holds
    /// one prompt's masks, not all of them.
    fn forward_into(&self, inputs: &NamedTensors, sink: &mut dyn OutputSink) -> Result<()> {
        let pixel_values = required(inputs, "pixel_values")?;
        let prompts = self.prompts_of(inputs)?;
        let (images, p) = (pixel_values.dim(0)?, prompts.len());
        for b in 0..images {
            let image = self.image_features(&pixel_values.narrow(0, b, 1)?)?;
            if b == 0 {
                sink.declare(&self.output_specs(images, &image, &prompts)?)?;
            }
            for (i, l) in image.levels.iter().enumerate() {
                sink.write(&format!("fpn_{i}"), b, l)?;
            }
            self.ground_each(&image, &prompts, &mut AllQueries(|name: &str, row, t: &Tensor| sink.write(name, b * p + row, t)))?;
        }
        sink.write(&format!("fpn_pos_{}", LEVELS - 1), 0, &self.position_map()?)?;
        sink.write("text_features", 0, &prompts.features)
    }
}

impl Sam3 {
    /// The prompts of a forward pass: `input_ids` (and `attention_mask`) when given, else every stored prompt.
    fn prompts_of(&self, inputs: &NamedTensors) -> Result<PromptFeatures> {
        match inputs.get("input_ids") {
            Some(ids) => {
                let ids = ids_from(ids, "input_ids")?;
                let mask = match inputs.get("attention_mask") {
                    Some(m) => m.clone(),
                    None => Tensor::ones(ids.dims(), DType::F32, ids.device())?,
                };
                self.prompt_features_from_ids(&ids, &mask)
            }
            None if !self.stored_prompts().is_empty() => self.prompt_features(self.stored_prompts()),
            None => Err(Error::Input("missing input `input_ids` (this file stores no prompts)".into())),
        }
    }

    /// Every output's (name, dtype, shape) for `images` images like `image` and `prompts`.
    fn output_specs(&self, images: usize, image: &ImageFeatures, prompts: &PromptFeatures) -> Result<Vec<(String, DType, Vec<usize>)>> {
        let dtype = self.pos.dtype();
        let rows = images * prompts.len();
        let q = self.config.detr_decoder_config.num_queries;
        let (_, _, mh, mw) = image.levels[0].dims4()?;
        let mut specs: Vec<(String, DType, Vec<usize>)> = GROUNDING_OUTPUTS
            .iter()
            .zip([vec![rows, q, mh, mw], vec![rows, q, 4], vec![rows, q], vec![rows, 1], vec![rows, 1, mh, mw]])
            .map(|(n, shape)| (n.to_string(), dtype, shape))
            .collect();
        for (i, l) in image.levels.iter().enumerate() {
            let mut shape = l.dims().to_vec();
            shape[0] = images;
            specs.push((format!("fpn_{i}"), l.dtype(), shape));
        }
        let g = self.vit.grid();
        specs.push((format!("fpn_pos_{}", LEVELS - 1), dtype, vec![1, self.config.width(), g, g]));
        specs.push(("text_features".into(), prompts.features.dtype(), prompts.features.dims().to_vec()));
        Ok(specs)
    }
}
