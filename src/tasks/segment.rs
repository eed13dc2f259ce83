//! Semantic segmentation on images: SegFormer's image processor, batched forward, then the logits
//! resized back to the image size with bilinear `align_corners=False` and the argmax over classes
//! (fused, see [`resize_argmax`]), as `SegformerImageProcessor` (transformers 5.24.0) does it; and
//! the optional remapping of checkpoint labels onto a project scheme ([`ClassMap`]).
use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use image::RgbImage;
use rayon::prelude::*;
use serde::Deserialize;

use super::Task;
use crate::error::{Error, Result};
use crate::kernels::bilinear_cpu::axis_taps;
use crate::models::footprint::Footprint;
use crate::models::segformer::{Config, SegformerForSemanticSegmentation, SegformerProcessor};
use crate::models::Checkpoint;
use crate::weights::Vb;

/// The largest class count a uint8 mask may carry: ids 0..=254, 255 is the ignore / no-data value
/// (`semantic_loss_ignore_index`).
pub const MAX_UINT8_CLASSES: usize = 255;

/// Bilinear resize (PyTorch `interpolate(size=(out_h, out_w), mode="bilinear", align_corners=False)`)
/// of `logits [C, h, w]` fused with the argmax over classes, without materialising the resized
/// logits: returns `out_h · out_w` class ids, row-major. Ties go to the lowest class id and NaN wins,
/// as `torch.argmax`.
pub fn resize_argmax(logits: &Tensor, out_h: usize, out_w: usize) -> Result<Vec<u32>> {
    let (c, h, w) = logits.dims3()?;
    if c == 0 || h == 0 || w == 0 || out_h == 0 || out_w == 0 {
        return Err(Error::Input(format!("resize_argmax: empty logits {:?} or target {out_h}x{out_w}", logits.dims())));
    }
    let data = logits.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    let rows = axis_taps(h, out_h);
    let cols = axis_taps(w, out_w);
    let plane = h * w;
    let mut out = vec![0u32; out_h * out_w];
    out.par_chunks_mut(out_w).enumerate().for_each(|(oy, orow)| {
        let (y0, y1, ly1) = rows[oy];
        let ly0 = 1.0 - ly1;
        for (ox, o) in orow.iter_mut().enumerate() {
            let (x0, x1, lx1) = cols[ox];
            let lx0 = 1.0 - lx1;
            let mut best = f32::NEG_INFINITY;
            let mut arg = 0u32;
            for k in 0..c {
                let p = &data[k * plane..][..plane];
                let v = ly0 * (lx0 * p[y0 * w + x0] + lx1 * p[y0 * w + x1]) + ly1 * (lx0 * p[y1 * w + x0] + lx1 * p[y1 * w + x1]);
                if best.is_nan() {
                    break;
                }
                if k == 0 || v > best || v.is_nan() {
                    best = v;
                    arg = k as u32;
                }
            }
            *o = arg;
        }
    });
    Ok(out)
}

/// The PASCAL VOC colour map (bit-interleaved; class 0 black), `n` entries.
pub(crate) fn default_palette(n: usize) -> Vec<[u8; 3]> {
    (0..n)
        .map(|i| {
            let (mut c, mut rgb) = (i, [0u8; 3]);
            for j in 0..8 {
                for (k, v) in rgb.iter_mut().enumerate() {
                    *v |= (((c >> k) & 1) as u8) << (7 - j);
                }
                c >>= 3;
            }
            rgb
        })
        .collect()
}

/// A class-map file (`--classes map.toml`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClassMapFile {
    /// Project class taking every checkpoint label not listed; absent: unlisted labels are an error.
    #[serde(default)]
    default: Option<String>,
    /// Project classes in output-id order.
    #[serde(rename = "class")]
    classes: Vec<ClassEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClassEntry {
    name: String,
    #[serde(default)]
    labels: Vec<LabelRef>,
    #[serde(default)]
    color: Option<[u8; 3]>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum LabelRef {
    Id(i64),
    Name(String),
}

/// The output classes of a segmentation run and the checkpoint-id → output-id lookup.
#[derive(Debug, Clone)]
pub struct ClassMap {
    /// Output class names by output id.
    pub names: Vec<String>,
    /// Palette colour by output id.
    pub colors: Vec<[u8; 3]>,
    /// Output id for each checkpoint class id.
    pub lut: Vec<u8>,
    /// Whether this is a remapping (`--classes`) rather than the checkpoint's own labels.
    pub remapped: bool,
    checkpoint_labels: Vec<String>,
}

impl ClassMap {
    /// The checkpoint's own classes; more than 255 is an error (uint8 output, 255 = ignore).
    pub fn identity(checkpoint_labels: &[String]) -> Result<Self> {
        let n = checkpoint_labels.len();
        if n == 0 || n > MAX_UINT8_CLASSES {
            return Err(Error::Config(format!(
                "the checkpoint has {n} classes; uint8 masks hold at most {MAX_UINT8_CLASSES} (ids 0-254, 255 = ignore): \
                 map them onto fewer classes with --classes"
            )));
        }
        Ok(ClassMap {
            names: checkpoint_labels.to_vec(),
            colors: default_palette(n),
            lut: (0..n as u32).map(|i| i as u8).collect(),
            remapped: false,
            checkpoint_labels: checkpoint_labels.to_vec(),
        })
    }

    /// Maps `checkpoint_labels` by name onto open-vocabulary `classes` (each a list of synonyms): a
    /// label equal to a synonym (trimmed, case-insensitive) takes that class, the first that has
    /// it; any other label takes `other` (a class id, or 255 for no data). So a closed-set model
    /// standing in for an open-vocabulary one writes the same class table.
    pub fn by_synonyms(checkpoint_labels: &[String], classes: &[Vec<String>], other: u8) -> Result<Self> {
        let n = classes.len();
        if n == 0 || n > MAX_UINT8_CLASSES || (other as usize >= n && other != 255) {
            return Err(Error::Config(format!("{n} classes with the others in class {other}: uint8 masks hold ids 0-254 (255 = ignore)")));
        }
        let same = |a: &str, b: &str| a.trim().eq_ignore_ascii_case(b.trim());
        let lut = checkpoint_labels.iter().map(|l| classes.iter().position(|syn| syn.iter().any(|s| same(s, l))).map_or(other, |c| c as u8)).collect();
        Ok(ClassMap {
            names: classes.iter().map(|s| s[0].clone()).collect(),
            colors: default_palette(n),
            lut,
            remapped: true,
            checkpoint_labels: checkpoint_labels.to_vec(),
        })
    }

    /// Reads a class-map TOML file for a checkpoint with `checkpoint_labels` (its `id2label`).
    pub fn load(path: &Path, checkpoint_labels: &[String]) -> Result<Self> {
        let text = crate::fsutil::read_input_text(path, crate::fsutil::MAX_TEXT_INPUT)?;
        Self::parse(&text, checkpoint_labels).map_err(|e| match e {
            Error::Config(m) => Error::bad_file(path, m),
            other => other,
        })
    }

    /// Parses a class map:
    /// ```toml
    /// default = "background"          # optional: class of every checkpoint label not listed
    /// [[class]]
    /// name = "background"
    /// [[class]]
    /// name = "building"
    /// labels = ["building", "house", 48]   # id2label names (trimmed, case-insensitive) or ids
    /// color = [180, 60, 60]                # optional palette colour
    /// ```
    pub fn parse(text: &str, checkpoint_labels: &[String]) -> Result<Self> {
        let bad = |m: String| Error::Config(format!("class map: {m}"));
        let f: ClassMapFile = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        let n_out = f.classes.len();
        if n_out == 0 {
            return Err(bad("no [[class]] entries".into()));
        }
        if n_out > MAX_UINT8_CLASSES {
            return Err(bad(format!(
                "{n_out} classes; uint8 masks hold at most {MAX_UINT8_CLASSES} (ids 0-254, 255 = ignore)"
            )));
        }
        let mut by_name: BTreeMap<String, usize> = BTreeMap::new();
        for (i, c) in f.classes.iter().enumerate() {
            let key = c.name.trim().to_lowercase();
            if key.is_empty() {
                return Err(bad(format!("class {i} has an empty name")));
            }
            if by_name.insert(key, i).is_some() {
                return Err(bad(format!("class `{}` is listed twice", c.name)));
            }
        }
        let mut label_ids: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, l) in checkpoint_labels.iter().enumerate() {
            label_ids.entry(l.trim().to_lowercase()).or_default().push(i);
        }
        let n_in = checkpoint_labels.len();
        let mut lut: Vec<Option<usize>> = vec![None; n_in];
        for (out, c) in f.classes.iter().enumerate() {
            for r in &c.labels {
                let id = match r {
                    LabelRef::Id(i) => {
                        if *i < 0 || *i as usize >= n_in {
                            return Err(bad(format!("class `{}`: label id {i} is outside the checkpoint's 0..{n_in}", c.name)));
                        }
                        *i as usize
                    }
                    LabelRef::Name(s) => match label_ids.get(&s.trim().to_lowercase()).map(|v| v.as_slice()) {
                        Some([one]) => *one,
                        Some(many) => {
                            return Err(bad(format!("class `{}`: label `{s}` is ambiguous (checkpoint ids {many:?}); use an id", c.name)))
                        }
                        None => return Err(bad(format!("class `{}`: the checkpoint has no label `{s}`", c.name))),
                    },
                };
                if let Some(prev) = lut[id] {
                    return Err(bad(format!(
                        "checkpoint label {id} (`{}`) is mapped to both `{}` and `{}`",
                        checkpoint_labels[id].trim(),
                        f.classes[prev].name,
                        c.name
                    )));
                }
                lut[id] = Some(out);
            }
        }
        let default = match &f.default {
            Some(d) => Some(*by_name.get(&d.trim().to_lowercase()).ok_or_else(|| bad(format!("default `{d}` is not a class")))?),
            None => None,
        };
        let unmapped: Vec<usize> = (0..n_in).filter(|&i| lut[i].is_none()).collect();
        if default.is_none() && !unmapped.is_empty() {
            let show: Vec<String> = unmapped.iter().take(8).map(|&i| format!("{i} `{}`", checkpoint_labels[i].trim())).collect();
            return Err(bad(format!(
                "{} checkpoint labels are not mapped (e.g. {}) and there is no `default`",
                unmapped.len(),
                show.join(", ")
            )));
        }
        let palette = default_palette(n_out);
        Ok(ClassMap {
            names: f.classes.iter().map(|c| c.name.trim().to_string()).collect(),
            colors: f.classes.iter().zip(palette).map(|(c, p)| c.color.unwrap_or(p)).collect(),
            lut: lut.into_iter().map(|o| o.or(default).unwrap_or(0) as u8).collect(),
            remapped: true,
            checkpoint_labels: checkpoint_labels.to_vec(),
        })
    }

    /// Output ids (uint8) for checkpoint class ids.
    pub fn apply(&self, ids: &[u32]) -> Result<Vec<u8>> {
        ids.iter()
            .map(|&i| {
                self.lut.get(i as usize).copied().ok_or_else(|| Error::Input(format!("class id {i} is outside the checkpoint's classes")))
            })
            .collect()
    }

    /// RGB bytes of a palette visualisation of output ids.
    pub fn colorize(&self, ids: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 3);
        for &i in ids {
            out.extend_from_slice(self.colors.get(i as usize).unwrap_or(&[255, 255, 255]));
        }
        out
    }

    /// The metadata JSON written into the mask PNG: output classes and, when remapped, which
    /// checkpoint labels each output class takes.
    pub fn metadata_json(&self) -> String {
        let mut v = serde_json::json!({
            "classes": self.names,
            "ignore_index": 255,
        });
        if self.remapped {
            let mapping: Vec<serde_json::Value> = (0..self.names.len())
                .map(|o| {
                    let srcs: Vec<serde_json::Value> = (0..self.lut.len())
                        .filter(|&i| self.lut[i] as usize == o)
                        .map(|i| serde_json::json!([i, self.checkpoint_labels[i].trim()]))
                        .collect();
                    serde_json::json!({"id": o, "name": self.names[o], "checkpoint_labels": srcs})
                })
                .collect();
            v["mapping"] = serde_json::Value::Array(mapping);
        }
        v.to_string()
    }
}

/// A loaded SegFormer with its image processor: images in, per-pixel checkpoint class ids out.
pub struct Segmenter {
    model: SegformerForSemanticSegmentation,
    processor: SegformerProcessor,
    labels: Vec<String>,
    /// For batch planning; `None` when built from parts (no config at hand).
    footprint: Option<Footprint>,
}

impl Segmenter {
    /// Opens a model directory (or weight file) whose architecture is `segformer`, reading
    /// `preprocessor_config.json` beside it when present.
    pub fn load(model: &Path, device: &Device, dtype: DType) -> Result<Self> {
        let ckpt = Checkpoint::open(model)?;
        let config = ckpt.config::<Config>().filter(|_| ckpt.serves(Task::Segmentation));
        let Some(config) = config else {
            return Err(Error::Config(format!(
                "{}: a `{}` model, not a SegFormer (model_type `segformer`): segment needs a segmentation model",
                model.display(),
                ckpt.architecture()
            )));
        };
        let vb = Vb::new(ckpt.store().clone(), dtype, device.clone());
        let model_ = ckpt.built(|| SegformerForSemanticSegmentation::load(&vb, config))?;
        let labels = model_.config().labels();
        Ok(Segmenter { model: model_, processor: SegformerProcessor::from_model_path(model)?, labels, footprint: ckpt.footprint(dtype) })
    }

    /// From parts already loaded.
    pub fn new(model: SegformerForSemanticSegmentation, processor: SegformerProcessor) -> Self {
        let labels = model.config().labels();
        Segmenter { model, processor, labels, footprint: None }
    }

    /// The checkpoint's class names by id.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// The image processor in use.
    pub fn processor(&self) -> &SegformerProcessor {
        &self.processor
    }

    /// Replaces the network input size (`(height, width)`).
    pub fn set_input_size(&mut self, size: Option<(usize, usize)>) {
        self.processor.size = size;
    }

    /// The model.
    pub fn model(&self) -> &SegformerForSemanticSegmentation {
        &self.model
    }

    /// Per image: checkpoint class ids at the image's own size (row-major, `height · width`).
    /// Estimated activation bytes of one forward-pass item for `image` (for batch planning).
    pub fn activation_bytes(&self, image: &RgbImage) -> Option<u64> {
        let source = (image.height() as usize, image.width() as usize);
        Some(self.footprint.as_ref()?.per_item(self.processor.input_size(image.width(), image.height()), source))
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// Images with the same network input size run as one batch.
    pub fn segment(&self, images: &[&RgbImage]) -> Result<Vec<Vec<u32>>> {
        let logits = self.logits(images)?;
        images.iter().zip(&logits).map(|(img, l)| resize_argmax(l, img.height() as usize, img.width() as usize)).collect()
    }

    /// Per image: the logits `[classes, h, w]` at the model's output resolution (before the resize
    /// to the image size). Images with the same network input size run as one batch.
    pub fn logits(&self, images: &[&RgbImage]) -> Result<Vec<Tensor>> {
        let device = self.model.device().clone();
        let mut out: Vec<Option<Tensor>> = vec![None; images.len()];
        let mut groups: BTreeMap<(usize, usize), Vec<usize>> = BTreeMap::new();
        for (i, img) in images.iter().enumerate() {
            groups.entry(self.processor.input_size(img.width(), img.height())).or_default().push(i);
        }
        for idx in groups.values() {
            crate::runner::check_injected_oom(idx.len())?;
            let xs = idx.iter().map(|&i| self.processor.apply(images[i], &device)).collect::<Result<Vec<_>>>()?;
            let batch = Tensor::stack(&xs, 0)?;
            let logits = crate::device::on_pool_worker(&device, || self.model.forward(&batch))?;
            for (k, &i) in idx.iter().enumerate() {
                out[i] = Some(logits.get(k)?);
            }
        }
        out.into_iter().map(|o| o.ok_or_else(|| Error::Input("an image got no logits".into()))).collect()
    }
}
