//! Per-item activation memory of a forward pass, for planning batches (`--batch auto`). Each
//! family estimates its own model from its typed config ([`super::Family::footprint`]); this
//! module holds what they share — the ViT + DPT estimate — and adds what every image costs around
//! the model: the preprocessed input and the result resized to the source image. The estimates
//! take the larger of the two phases of a pass (the backbone's layers, then the decoder, which
//! runs once the backbone's activations are freed), sum the large tensors alive at each phase's
//! peak, and are meant to err high; `docs/memory.md` records them against measured runs.
use std::sync::Arc;

/// Bytes of one f32 element (inputs and results are f32 whatever the model computes in).
const F32: u64 = 4;

/// A ViT backbone followed by a DPT neck and head, by its sizes.
pub(crate) struct VitDpt {
    pub patch: u64,
    pub hidden: u64,
    pub heads: u64,
    pub mlp: u64,
    pub extra_tokens: u64,
    pub kept_layers: u64,
    pub neck: Vec<u64>,
    pub fusion: u64,
    pub head: u64,
    pub out_channels: u64,
    /// Full-resolution maps of the head's width (the larger of `fusion / 2` and `head`) alive at
    /// once in the head: 2 where measured (DA-V2: the upsampled map and the convolution's output,
    /// docs/memory.md), 4 (every convolution's input and output) where not.
    pub head_maps: u64,
    /// Full-resolution maps of `out_channels` alive after the head (CHMv2 turns its bins into
    /// heights through a softmax and a weighted sum: two more such maps).
    pub post_maps: u64,
}

impl VitDpt {
    /// Bytes of one item at network input `h × w`, `elem` bytes per element.
    pub(crate) fn bytes(&self, h: u64, w: u64, elem: u64) -> u64 {
        let p = self.patch.max(1);
        let (gh, gw) = (h.div_ceil(p), w.div_ceil(p));
        let t = gh * gw + self.extra_tokens;
        let d = self.hidden;
        // The worst layer: qkv, scores and probabilities, residual stream (attention) or the MLP.
        let attention = 5 * t * d + 2 * self.heads * t * t;
        let mlp = 2 * t * d + 2 * self.mlp * t;
        let kept = self.kept_layers * t * d;
        let backbone = attention.max(mlp) + kept;
        // Neck maps at 4×, 2×, 1×, ½× the patch grid, each with its fusion-width projection.
        let grid = gh * gw;
        let areas = [16 * grid, 4 * grid, grid, grid / 4];
        let neck: u64 = self.neck.iter().zip(areas).map(|(&c, a)| (c + self.fusion) * a).sum();
        // Fusion upsamples to 8× the grid; the head works at the input resolution.
        let fusion = 2 * self.fusion * grid * 64;
        let head = self.head_maps * (self.fusion / 2).max(self.head) * h * w + (1 + self.post_maps) * self.out_channels * h * w;
        // The decoder keeps the backbone's chosen layers, the neck and fusion maps, and the head.
        backbone.max(kept + neck + fusion + head) * elem
    }
}

/// A family's estimate of its model's activation bytes for one item at network input `(h, w)`
/// with `elem` bytes per element.
pub(crate) type ModelEstimate = Arc<dyn Fn(u64, u64, u64) -> u64 + Send + Sync>;

/// What a loaded model needs to estimate its per-item activations.
#[derive(Clone)]
pub struct Footprint {
    model: ModelEstimate,
    elem: u64,
}

impl std::fmt::Debug for Footprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Footprint").field("elem", &self.elem).finish_non_exhaustive()
    }
}

impl Footprint {
    /// The family's `model` estimate for a model computing in `dtype`.
    pub fn new(model: ModelEstimate, dtype: candle_core::DType) -> Self {
        Footprint { model, elem: dtype.size_in_bytes().max(2) as u64 }
    }

    /// Estimated bytes of one item at network input `input` from a `source` image (both H, W):
    /// the model's activations, the preprocessed input (f32) and the output resized back to the
    /// source (f32, twice for the resize).
    pub fn per_item(&self, input: (usize, usize), source: (usize, usize)) -> u64 {
        let (h, w) = (input.0 as u64, input.1 as u64);
        let io = 3 * h * w * F32 + 2 * (source.0 as u64) * (source.1 as u64) * F32;
        (self.model)(h, w, self.elem) + io
    }
}
