//! Per-item activation memory of a forward pass, estimated from the model config and the input
//! size, for planning batches (`--batch auto`). The estimate sums the large tensors alive at the
//! peak: the backbone's attention (scores and probabilities per head), its MLP, the feature maps kept
//! for the head, the DPT fusion and head maps at up to the input resolution (or SegFormer's
//! decode head), plus the preprocessed input and the result resized to the source image. It is
//! meant to err high; `docs/memory.md` records it against measured runs.
use serde_json::Value;

/// Bytes of one f32 element (activations are computed in f32 unless the model runs in f16/bf16).
const F32: u64 = 4;

fn num(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

fn list(v: &Value, key: &str) -> Option<Vec<u64>> {
    v.get(key)?.as_array()?.iter().map(Value::as_u64).collect()
}

/// A ViT backbone followed by a DPT neck and head, by its sizes.
struct VitDpt {
    patch: u64,
    hidden: u64,
    heads: u64,
    mlp: u64,
    extra_tokens: u64,
    kept_layers: u64,
    neck: Vec<u64>,
    fusion: u64,
    head: u64,
    out_channels: u64,
    /// Full-resolution maps of `out_channels` alive after the head (CHMv2 turns its bins into
    /// heights through a softmax and a weighted sum: two more such maps).
    post_maps: u64,
}

impl VitDpt {
    fn bytes(&self, h: u64, w: u64, elem: u64) -> u64 {
        let p = self.patch.max(1);
        let (gh, gw) = (h.div_ceil(p), w.div_ceil(p));
        let t = gh * gw + self.extra_tokens;
        let d = self.hidden;
        // The worst layer: qkv, scores and probabilities, residual stream (attention) or the MLP.
        let attention = 5 * t * d + 2 * self.heads * t * t;
        let mlp = 2 * t * d + 2 * self.mlp * t;
        let backbone = attention.max(mlp) + self.kept_layers * t * d;
        // Neck maps at 4×, 2×, 1×, ½× the patch grid, each with its fusion-width projection.
        let grid = gh * gw;
        let areas = [16 * grid, 4 * grid, grid, grid / 4];
        let neck: u64 = self.neck.iter().zip(areas).map(|(&c, a)| (c + self.fusion) * a).sum();
        // Fusion upsamples to 8× the grid; the head works at the input resolution.
        let fusion = 2 * self.fusion * grid * 64;
        let head = 2 * (self.fusion / 2) * h * w + 2 * self.head * h * w + (1 + self.post_maps) * self.out_channels * h * w;
        (backbone + neck + fusion + head) * elem
    }
}

fn da2(cfg: &Value) -> Option<VitDpt> {
    let b = cfg.get("backbone_config")?;
    let hidden = num(b, "hidden_size")?;
    let ratio = b.get("mlp_ratio").and_then(Value::as_f64).unwrap_or(4.0);
    Some(VitDpt {
        patch: num(b, "patch_size").or(num(cfg, "patch_size")).unwrap_or(14),
        hidden,
        heads: num(b, "num_attention_heads")?,
        mlp: (hidden as f64 * ratio) as u64,
        extra_tokens: 1,
        kept_layers: 4,
        neck: list(cfg, "neck_hidden_sizes").unwrap_or_else(|| vec![hidden; 4]),
        fusion: num(cfg, "fusion_hidden_size").unwrap_or(64),
        head: num(cfg, "head_hidden_size").unwrap_or(32),
        out_channels: 1,
        post_maps: 0,
    })
}

fn chmv2(cfg: &Value) -> Option<VitDpt> {
    let b = cfg.get("backbone_config")?;
    let hidden = num(b, "hidden_size")?;
    Some(VitDpt {
        patch: num(b, "patch_size").or(num(cfg, "patch_size")).unwrap_or(16),
        hidden,
        heads: num(b, "num_attention_heads")?,
        mlp: num(b, "intermediate_size").unwrap_or(4 * hidden),
        extra_tokens: 1 + num(b, "num_register_tokens").unwrap_or(0),
        kept_layers: list(b, "out_indices").map(|v| v.len() as u64).unwrap_or(4),
        neck: list(cfg, "post_process_channels").unwrap_or_else(|| vec![128, 256, 512, 1024]),
        fusion: num(cfg, "fusion_hidden_size").unwrap_or(256),
        head: num(cfg, "head_hidden_size").unwrap_or(128),
        out_channels: num(cfg, "number_output_channels").unwrap_or(256),
        post_maps: 2,
    })
}

fn da3(cfg: &Value) -> Option<VitDpt> {
    let (net, head) = match cfg.get("model_name").and_then(Value::as_str).and_then(super::da3::preset) {
        Some(p) => p,
        None => (serde_json::from_value(cfg.get("net")?.clone()).ok()?, serde_json::from_value(cfg.get("head")?.clone()).ok()?),
    };
    let (d, heads) = match net.name.as_str() {
        "vits" => (384, 6),
        "vitb" => (768, 12),
        "vitg" => (1536, 24),
        _ => (1024, 16),
    };
    let hidden = net.embed_dim.unwrap_or(d) as u64;
    Some(VitDpt {
        patch: net.patch_size as u64,
        hidden,
        heads: net.num_heads.unwrap_or(heads) as u64,
        mlp: (hidden as f64 * net.mlp_ratio.unwrap_or(4.0)) as u64,
        extra_tokens: 2,
        kept_layers: net.out_layers.len() as u64,
        neck: head.out_channels.iter().map(|&c| c as u64).collect(),
        fusion: head.features as u64,
        head: 32,
        out_channels: head.output_dim as u64,
        post_maps: 0,
    })
}

fn segformer(cfg: &Value, h: u64, w: u64, elem: u64) -> Option<u64> {
    let hidden = list(cfg, "hidden_sizes")?;
    let heads = list(cfg, "num_attention_heads")?;
    let sr = list(cfg, "sr_ratios").unwrap_or_else(|| vec![8, 4, 2, 1]);
    let ratios = list(cfg, "mlp_ratios").unwrap_or_else(|| vec![4; hidden.len()]);
    let mut peak = 0u64;
    let (mut sh, mut sw) = (h.div_ceil(4), w.div_ceil(4));
    for i in 0..hidden.len() {
        let n = sh * sw;
        let r = sr.get(i).copied().unwrap_or(1).max(1);
        let keys = (sh.div_ceil(r) * sw.div_ceil(r)).max(1);
        let c = hidden[i];
        let attention = 4 * n * c + 2 * heads.get(i).copied().unwrap_or(1) * n * keys;
        let mlp = 3 * ratios.get(i).copied().unwrap_or(4) * c * n + 2 * n * c;
        peak = peak.max(attention.max(mlp));
        sh = sh.div_ceil(2);
        sw = sw.div_ceil(2);
    }
    let n0 = h.div_ceil(4) * w.div_ceil(4);
    let dec = num(cfg, "decoder_hidden_size").unwrap_or(256);
    let labels = cfg.get("id2label").and_then(Value::as_object).map(|m| m.len() as u64).unwrap_or(150);
    // The decode head: the concatenation of the four upsampled maps, the fused map and the logits
    // (the logits are resized to each image one image at a time, outside the batch).
    let decode = 4 * dec * n0 + dec * n0 + labels * n0;
    let kept: u64 = hidden.iter().enumerate().map(|(i, c)| c * n0 / (1 << (2 * i))).sum();
    // The encoder's worst block and the decode head do not overlap in time.
    Some((peak.max(decode) + kept) * elem)
}

/// What a loaded model needs to estimate its per-item activations.
#[derive(Debug, Clone)]
pub struct Footprint {
    arch: String,
    config: Value,
    elem: u64,
}

impl Footprint {
    /// For a model of `arch` with `config`, computing in `dtype`.
    pub fn new(arch: &str, config: &Value, dtype: candle_core::DType) -> Self {
        Footprint { arch: arch.to_string(), config: config.clone(), elem: dtype.size_in_bytes().max(2) as u64 }
    }

    /// Estimated bytes of one item at network input `input` from a `source` image (both H, W).
    pub fn per_item(&self, input: (usize, usize), source: (usize, usize)) -> Option<u64> {
        activation_bytes(&self.arch, &self.config, input, source, self.elem)
    }
}

/// Estimated activation bytes of one item through `arch` (`model_type`) configured by `cfg`, at
/// network input `input` (H, W) from a `source` (H, W) image, with `elem` bytes per element.
/// `None` for architectures it does not know (callers then use a fixed batch).
pub fn activation_bytes(arch: &str, cfg: &Value, input: (usize, usize), source: (usize, usize), elem: u64) -> Option<u64> {
    let (h, w) = (input.0 as u64, input.1 as u64);
    let model = match arch {
        "depth_anything" => da2(cfg)?.bytes(h, w, elem),
        "chmv2" => chmv2(cfg)?.bytes(h, w, elem),
        "da3" | "da3_mono" | "da3_metric" | "da3_nested" => da3(cfg)?.bytes(h, w, elem),
        "segformer" => segformer(cfg, h, w, elem)?,
        _ => return None,
    };
    // Preprocessed input (f32) and the output resized back to the source (f32, twice for the resize).
    let io = 3 * h * w * F32 + 2 * (source.0 as u64) * (source.1 as u64) * F32;
    Some(model + io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(path: &str) -> Value {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(path).join("config.json");
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    }

    #[test]
    fn estimates_grow_with_the_input_and_know_each_family() {
        for (dir, arch) in [("da2_relative_p14", "depth_anything"), ("chmv2_tiny", "chmv2"), ("segformer_tiny", "segformer"), ("da3_mono", "da3_mono")] {
            let c = cfg(dir);
            let small = activation_bytes(arch, &c, (112, 112), (100, 100), 4).unwrap();
            let big = activation_bytes(arch, &c, (224, 224), (100, 100), 4).unwrap();
            assert!(small > 0 && big > 3 * small, "{dir}: {small} → {big}");
        }
        assert!(activation_bytes("lgatr", &Value::Null, (1, 1), (1, 1), 4).is_none());
    }
}
