//! One validation for every number read from a model config (`config.json`, a GGUF's `edgerun.config`)
//! or a `preprocessor_config.json`: positive where it must be, bounded, and the sizes it implies
//! computed with checked arithmetic, before anything is allocated from it.
//!
//! A refusal is an [`Error::Config`] naming the key, the value and the limit; the loaders add the
//! file with [`in_file`]. The limits are listed in the README ("Limits").
use crate::error::{Error, Result};

/// Largest patch size (ViT patch embedding, SegFormer patch kernel).
pub(crate) const MAX_PATCH: usize = 64;
/// Largest token width or channel count of a layer.
pub(crate) const MAX_WIDTH: usize = 16_384;
/// Largest MLP hidden width.
pub(crate) const MAX_MLP_WIDTH: usize = 4 * MAX_WIDTH;
/// Largest number of input channels of an image model.
pub(crate) const MAX_INPUT_CHANNELS: usize = 64;
/// Largest number of attention heads.
pub(crate) const MAX_HEADS: usize = 1024;
/// Largest number of transformer blocks (or blocks per stage).
pub(crate) const MAX_LAYERS: usize = 256;
/// Largest training image size or preprocessor target size, in pixels per side.
pub(crate) const MAX_IMAGE_SIZE: usize = 8192;
/// Largest `ensure_multiple_of` / `size_divisor`.
pub(crate) const MAX_MULTIPLE: usize = 1024;
/// Largest MLP ratio (MLP width / token width).
pub(crate) const MAX_RATIO: f64 = 64.0;
/// Largest number of output classes or depth bins.
pub(crate) const MAX_CLASSES: usize = 65_536;
/// Largest number of pyramid levels of a DPT neck or SegFormer encoder.
pub(crate) const MAX_LEVELS: usize = 8;
/// Largest DPT reassemble factor (and largest inverse of one below 1).
pub(crate) const MAX_REASSEMBLE: f64 = 16.0;
/// Largest depth or height value a config may scale outputs to (`max_depth`, metres or units).
pub(crate) const MAX_DEPTH_VALUE: f64 = 1e6;
/// Largest network input side in pixels (after preprocessing).
pub(crate) const MAX_INPUT_SIDE: usize = 32_768;
/// Largest network input in pixels (after preprocessing): 16384².
pub(crate) const MAX_INPUT_PIXELS: usize = 1 << 28;

/// Adds the config's origin (`…/config.json`, `… (metadata edgerun.config)`) to a config error.
pub(crate) fn in_file(origin: &str, e: Error) -> Error {
    match e {
        Error::Config(m) => Error::Config(format!("{origin}: {m}")),
        other => other,
    }
}

/// The numbers of one config section; keys are named with the section's prefix
/// (e.g. `backbone_config.patch_size`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Section<'a> {
    prefix: &'a str,
}

impl<'a> Section<'a> {
    /// The top level of a config.
    pub(crate) fn root() -> Self {
        Section { prefix: "" }
    }

    /// The section under `prefix` (written without the trailing dot).
    pub(crate) fn at(prefix: &'a str) -> Self {
        Section { prefix }
    }

    /// The full name of `key` in this section.
    pub(crate) fn key(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    /// An error about `key`.
    pub(crate) fn bad(&self, key: &str, msg: impl std::fmt::Display) -> Error {
        Error::Config(format!("`{}` {msg}", self.key(key)))
    }

    /// `v` within `lo..=hi`.
    pub(crate) fn range(&self, key: &str, v: usize, lo: usize, hi: usize) -> Result<usize> {
        if (lo..=hi).contains(&v) {
            Ok(v)
        } else {
            Err(self.bad(key, format!("= {v} is outside {lo}..={hi}")))
        }
    }

    /// `v` within `1..=max`.
    pub(crate) fn count(&self, key: &str, v: usize, max: usize) -> Result<usize> {
        self.range(key, v, 1, max)
    }

    /// Every entry of `vs` within `lo..=hi` (keys `key[i]`).
    pub(crate) fn each(&self, key: &str, vs: &[usize], lo: usize, hi: usize) -> Result<()> {
        for (i, &v) in vs.iter().enumerate() {
            self.range(&format!("{key}[{i}]"), v, lo, hi)?;
        }
        Ok(())
    }

    /// A finite `v` within `lo..=hi`.
    pub(crate) fn real(&self, key: &str, v: f64, lo: f64, hi: f64) -> Result<f64> {
        if v.is_finite() && v >= lo && v <= hi {
            Ok(v)
        } else {
            Err(self.bad(key, format!("= {v} is outside {lo}..={hi}")))
        }
    }

    /// A finite `v` with `0 < v ≤ hi`.
    pub(crate) fn positive(&self, key: &str, v: f64, hi: f64) -> Result<f64> {
        if v.is_finite() && v > 0.0 && v <= hi {
            Ok(v)
        } else {
            Err(self.bad(key, format!("= {v} must be positive and at most {hi}")))
        }
    }

    /// `heads` in `1..=MAX_HEADS` dividing `width`.
    pub(crate) fn heads(&self, key: &str, heads: usize, width_key: &str, width: usize) -> Result<usize> {
        self.count(key, heads, MAX_HEADS)?;
        if !width.is_multiple_of(heads) {
            return Err(self.bad(key, format!("= {heads} does not divide `{}` = {width}", self.key(width_key))));
        }
        Ok(heads)
    }

    /// The integer part of `width · ratio` (Python's `int(width * ratio)`), within `1..=max`.
    pub(crate) fn scaled(&self, key: &str, width: usize, ratio: f64, max: usize) -> Result<usize> {
        self.positive(key, ratio, MAX_RATIO)?;
        let v = width as f64 * ratio;
        if !(v >= 1.0 && v <= max as f64) {
            return Err(self.bad(key, format!("= {ratio} gives a width of {v}, outside 1..={max}")));
        }
        Ok(v as usize)
    }
}

/// Largest absolute per-channel mean and largest std of a preprocessor's normalisation.
pub(crate) const MAX_NORM_VALUE: f64 = 1e4;

impl Section<'_> {
    /// A preprocessor target size `{height, width}`, each in `1..=MAX_IMAGE_SIZE`.
    pub(crate) fn image_size(&self, key: &str, h: usize, w: usize) -> Result<(usize, usize)> {
        let h = self.count(&format!("{key}.height"), h, MAX_IMAGE_SIZE)?;
        let w = self.count(&format!("{key}.width"), w, MAX_IMAGE_SIZE)?;
        Ok((h, w))
    }

    /// Per-channel `image_mean` (finite, |x| ≤ MAX_NORM_VALUE) and `image_std` (positive, ≤ MAX_NORM_VALUE).
    pub(crate) fn mean_std(&self, mean: &[f32; 3], std: &[f32; 3]) -> Result<()> {
        for c in 0..3 {
            self.real(&format!("image_mean[{c}]"), mean[c] as f64, -MAX_NORM_VALUE, MAX_NORM_VALUE)?;
            self.positive(&format!("image_std[{c}]"), std[c] as f64, MAX_NORM_VALUE)?;
        }
        Ok(())
    }
}

/// A DPT reassemble factor: an integer in `2..=16` (transposed conv), 1, or `1/s` with `s` in
/// `2..=16` (strided conv).
pub(crate) fn check_reassemble_factor(s: &Section, key: &str, f: f64) -> Result<f64> {
    let ok = if f >= 1.0 {
        f <= MAX_REASSEMBLE && f.fract() == 0.0
    } else {
        f > 0.0 && 1.0 / f <= MAX_REASSEMBLE + 1e-9
    };
    if ok {
        Ok(f)
    } else {
        Err(s.bad(key, format!("= {f} is not an integer in 1..={MAX_REASSEMBLE} or a fraction down to 1/{MAX_REASSEMBLE}")))
    }
}

/// `a · b` or an error naming `what`.
pub(crate) fn mul(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| Error::Config(format!("{what}: {a} × {b} overflows")))
}

/// Checks a network input of `h`×`w` pixels and `channels` channels against [`MAX_INPUT_SIDE`]
/// and [`MAX_INPUT_PIXELS`] before it is allocated; returns its element count.
pub(crate) fn input_elements(h: usize, w: usize, channels: usize) -> Result<usize> {
    if h == 0 || w == 0 || h > MAX_INPUT_SIDE || w > MAX_INPUT_SIDE {
        return Err(Error::Input(format!("network input {h}×{w} is outside 1..={MAX_INPUT_SIDE} pixels per side")));
    }
    let px = h * w;
    if px > MAX_INPUT_PIXELS {
        return Err(Error::Input(format!("network input {h}×{w} has {px} pixels, more than the limit {MAX_INPUT_PIXELS}")));
    }
    mul("network input elements", px, channels).map_err(|e| Error::Input(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_key_value_and_limit() {
        let e = Section::at("backbone_config").count("patch_size", 0, MAX_PATCH).unwrap_err().to_string();
        assert!(e.contains("backbone_config.patch_size") && e.contains("= 0") && e.contains("1..=64"), "{e}");
        let e = Section::root().heads("num_attention_heads", 5, "hidden_size", 384).unwrap_err().to_string();
        assert!(e.contains("does not divide `hidden_size` = 384"), "{e}");
        assert!(Section::root().real("x", f64::NAN, 0.0, 1.0).is_err());
        assert!(mul("m", usize::MAX, 2).is_err());
        assert_eq!(in_file("a/config.json", Error::Config("x".into())).to_string(), "config: a/config.json: x");
    }
}
