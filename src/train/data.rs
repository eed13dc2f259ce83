//! Training data: `DIR/images/<name>.{png,jpg,jpeg,tif,tiff}` paired with `DIR/targets/<name>.npy`
//! (depth, canopy height) or `DIR/targets/<name>.png` (class ids), a train/validation split fixed by
//! file name, and samples at the training resolution.
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::rng::SplitMix;
use crate::error::{Error, Result};
use crate::imageio::class_map::read_class_png;
use crate::imageio::decode::file_header_size;
use crate::imageio::npy::read_npy_2d;
use crate::imageio::resample::{resize, Filter};
use crate::imageio::{load_rgb, ImageLimits};

/// What a target file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TargetKind {
    /// `<name>.npy`: a float map (f16/f32), NaN = ignore.
    Values,
    /// `<name>.png`: 8-bit class ids (grey level or palette index); the ignore index is ignored.
    Classes,
}

impl TargetKind {
    /// The target file suffix.
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            TargetKind::Values => "npy",
            TargetKind::Classes => "png",
        }
    }
}

/// Image suffixes looked for under `images/`.
pub const IMAGE_SUFFIXES: &[&str] = &["png", "jpg", "jpeg", "tif", "tiff"];
/// Most images in one data directory.
pub(crate) const MAX_ITEMS: usize = 1_000_000;

/// One image and its target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pair {
    /// The file stem shared by image and target.
    pub name: String,
    /// The image.
    pub image: PathBuf,
    /// The target map.
    pub target: PathBuf,
}

/// The pairs of a data directory, split into training and validation.
#[derive(Debug, Clone)]
pub(crate) struct Dataset {
    /// Training pairs, sorted by name.
    pub train: Vec<Pair>,
    /// Validation pairs, sorted by name.
    pub val: Vec<Pair>,
}

/// FNV-1a of a name: the split key, independent of listing order and of the other files.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

impl Dataset {
    /// Lists `data/images`, pairs each image with `data/targets/<stem>.<npy|png>` (a missing target is
    /// an error naming it) and holds out `⌈n · val_fraction⌉` pairs, the ones with the smallest name hash.
    /// A symbolic link (`images/`, `targets/` or a file in them) that leads out of `data` is an error,
    /// as every command refuses to follow one out of its input root.
    pub(crate) fn open(data: &Path, val_fraction: f64, kind: TargetKind) -> Result<Self> {
        let images = data.join("images");
        let targets = data.join("targets");
        let root = data.canonicalize().map_err(|e| Error::io(data, e))?;
        let inside = |p: &Path| -> Result<()> {
            let is_link = std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink());
            if is_link && !p.canonicalize().is_ok_and(|c| c.starts_with(&root)) {
                return Err(Error::bad_file(p, format!("a symbolic link out of the data directory {}: not followed (links are followed only inside it)", data.display())));
            }
            Ok(())
        };
        inside(&images)?;
        inside(&targets)?;
        let list = std::fs::read_dir(&images).map_err(|e| Error::Io { path: images.clone(), source: e })?;
        let mut pairs = Vec::new();
        for entry in list {
            let entry = entry.map_err(|e| Error::Io { path: images.clone(), source: e })?;
            let path = entry.path();
            let Some(ext) = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase) else { continue };
            if !IMAGE_SUFFIXES.contains(&ext.as_str()) || !path.is_file() {
                continue;
            }
            inside(&path)?;
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .ok_or_else(|| Error::bad_file(&path, "the file name is not valid UTF-8"))?
                .to_string();
            let target = targets.join(format!("{name}.{}", kind.suffix()));
            if !target.is_file() {
                return Err(Error::bad_file(&path, format!("no target: {} is missing", target.display())));
            }
            inside(&target)?;
            pairs.push(Pair { name, image: path, target });
            if pairs.len() > MAX_ITEMS {
                return Err(Error::bad_file(&images, format!("more than {MAX_ITEMS} images")));
            }
        }
        pairs.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = pairs.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(Error::bad_file(&w[1].image, format!("two images share the name `{}`", w[0].name)));
        }
        if pairs.is_empty() {
            return Err(Error::bad_file(&images, format!("no images ({})", IMAGE_SUFFIXES.join(", "))));
        }
        let n_val = if val_fraction > 0.0 { ((pairs.len() as f64 * val_fraction).ceil() as usize).min(pairs.len() - 1) } else { 0 };
        let mut by_hash: Vec<usize> = (0..pairs.len()).collect();
        by_hash.sort_by_key(|&i| (name_hash(&pairs[i].name), i));
        let held: std::collections::BTreeSet<usize> = by_hash[..n_val].iter().copied().collect();
        let (mut train, mut val) = (Vec::new(), Vec::new());
        for (i, p) in pairs.into_iter().enumerate() {
            if held.contains(&i) { val.push(p) } else { train.push(p) }
        }
        Ok(Dataset { train, val })
    }
}

/// How a training sample is made from a pair.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SampleSpec {
    /// Training resolution (H, W).
    pub size: (usize, usize),
    /// Normalisation mean (RGB).
    pub mean: [f32; 3],
    /// Normalisation std (RGB).
    pub std: [f32; 3],
    /// The resampling filter of the model's own preprocessing.
    pub filter: Filter,
    /// What the targets hold.
    pub target: TargetKind,
}

/// Light augmentation drawn per sample: brightness, contrast, gamma, noise, horizontal flip.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Augment {
    brightness: f32,
    contrast: f32,
    gamma: f32,
    noise: f32,
    flip: bool,
    noise_seed: u64,
}

impl Augment {
    /// Draws the augmentation of one sample from `rng`.
    pub(crate) fn draw(rng: &mut SplitMix) -> Self {
        Augment {
            brightness: rng.uniform(0.8, 1.2) as f32,
            contrast: rng.uniform(0.8, 1.2) as f32,
            gamma: rng.uniform(0.8, 1.25) as f32,
            noise: rng.uniform(0.0, 0.02) as f32,
            flip: rng.uniform(0.0, 1.0) < 0.5,
            noise_seed: rng.next_u64(),
        }
    }

    fn apply_photometric(&self, rgb: &mut [f32]) {
        let mean = rgb.iter().sum::<f32>() / rgb.len().max(1) as f32;
        let mut noise = SplitMix::new(self.noise_seed);
        for v in rgb.iter_mut() {
            let x = ((*v * self.brightness - mean) * self.contrast + mean).clamp(0.0, 1.0);
            *v = (x.powf(self.gamma) + self.noise * noise.normal() as f32).clamp(0.0, 1.0);
        }
    }

    fn flip_rows(&self, planes: &mut [f32], w: usize) {
        if self.flip {
            for row in planes.chunks_exact_mut(w) {
                row.reverse();
            }
        }
    }
}

/// The model input of `pair`: its image resized to `spec.size` with the model's filter, optionally
/// augmented, normalised → `[3, H, W]`.
pub(crate) fn load_pixels(pair: &Pair, spec: &SampleSpec, augment: Option<Augment>, device: &Device) -> Result<Tensor> {
    let img = load_rgb(&pair.image, &ImageLimits::default())?;
    let (h, w) = spec.size;
    crate::config_check::input_elements(h, w, 3)?;
    let resized = resize(&img, w as u32, h as u32, spec.filter);
    let mut rgb = vec![0f32; 3 * h * w];
    for (i, px) in resized.as_raw().chunks_exact(3).enumerate() {
        for c in 0..3 {
            rgb[c * h * w + i] = px[c] as f32 / 255.0;
        }
    }
    if let Some(a) = augment {
        a.apply_photometric(&mut rgb);
        a.flip_rows(&mut rgb, w);
    }
    for c in 0..3 {
        for v in &mut rgb[c * h * w..(c + 1) * h * w] {
            *v = (*v - spec.mean[c]) / spec.std[c];
        }
    }
    Ok(Tensor::from_vec(rgb, (3, h, w), device)?)
}

/// The target of `pair` at `spec.size` (nearest neighbour; it must have its image's size, read from
/// the image header), flipped with the image when `augment` flips → `[H, W]` f32 (class ids as values).
pub(crate) fn load_target(pair: &Pair, spec: &SampleSpec, augment: Option<Augment>, device: &Device) -> Result<Tensor> {
    let limits = ImageLimits::default();
    let ((th, tw), values) = match spec.target {
        TargetKind::Values => read_npy_2d(&pair.target)?,
        TargetKind::Classes => {
            let (dims, ids) = read_class_png(&pair.target, &limits)?;
            (dims, ids.into_iter().map(f32::from).collect())
        }
    };
    let (iw, ih) = file_header_size(&pair.image, &limits)?;
    if (th, tw) != (ih as usize, iw as usize) {
        return Err(Error::bad_file(&pair.target, format!("target is {th}×{tw}, but its image {} is {ih}×{iw}", pair.image.display())));
    }
    let (h, w) = spec.size;
    crate::config_check::input_elements(h, w, 1)?;
    let mut target = vec![0f32; h * w];
    for y in 0..h {
        let sy = (y * th / h).min(th - 1);
        for x in 0..w {
            target[y * w + x] = values[sy * tw + (x * tw / w).min(tw - 1)];
        }
    }
    if let Some(a) = augment {
        a.flip_rows(&mut target, w);
    }
    Ok(Tensor::from_vec(target, (h, w), device)?)
}
