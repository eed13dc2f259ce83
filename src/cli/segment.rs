//! `edgerun segment --model M [--classes map.toml] [--palette] [--tile PX --overlap PX] <images or dirs…> --out DIR`;
//! with a SAM 3 model, open-vocabulary classes ([`super::segment_open`]).
//!
//! Writes `<stem>.seg.png` (8-bit grayscale class ids, lossless; metadata `edgerun:classes` holds the
//! class names and, with `--classes`, the checkpoint labels each output class takes) and, with
//! `--palette`, `<stem>.seg.color.png`. A tiled input gets `<stem>.seg.tif` instead (uint8 tiled
//! GeoTIFF, 255 where the source is no-data, the same class table as its ImageDescription).
use std::path::PathBuf;

use anyhow::Context;
use argh::FromArgs;
use edgerun::imageio::{write_png_gray8, write_png_rgb8, ImageLimits};
use edgerun::runner::BatchSetting;
use edgerun::inputs::{collect_inputs, InputItem, IMAGE_SUFFIXES};
use edgerun::tasks::open_vocab::open_sam3;
use edgerun::tasks::segment::{ClassMap, Segmenter};
use edgerun::tasks::tiles::{seg_default, SegTiles};
use edgerun::tiling::Output;

use super::common::{compute, usage};
use super::run_inputs::{create_out_dir, output_path, progress_mode, resolve_budget, run_items, state_file, RunSpec};
use super::tiled::{self, Loaded};

/// Semantic segmentation of images (SegFormer; or SAM 3 with classes named in words, SegEarth-OV-3): `<stem>.seg.png` (uint8 class ids), mirroring the input tree under --out.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "segment")]
pub struct Args {
    /// a SegFormer or SAM 3 model directory (config.json + model.safetensors [+ preprocessor_config.json]) or `.gguf` (required)
    #[argh(option)]
    pub(super) model: PathBuf,
    /// class map (TOML) from a SegFormer checkpoint's labels onto a project scheme; with SAM 3, a class
    /// file (one class per line, synonyms comma-separated, as SegEarth-OV-3's `cls_*.txt`)
    #[argh(option)]
    pub(super) classes: Option<PathBuf>,
    /// with SAM 3, the classes on the command line, `;` between classes, `,` between synonyms
    /// (e.g. "background;building,roof,house;tree,forest")
    #[argh(option)]
    pub(super) prompts: Option<String>,
    /// with SAM 3: a SegEarth-OV-3 dataset setting (classes and thresholds): openearthmap, loveda, isaid,
    /// potsdam, vaihingen, uavid, udd5 or vdd
    #[argh(option)]
    pub(super) preset: Option<String>,
    /// with SAM 3: a query counts when its score exceeds this (default 0.5, or the preset's)
    #[argh(option)]
    pub(super) conf: Option<f32>,
    /// with SAM 3: pixels whose best class score is below this take --bg-idx (default 0.0, or the preset's)
    #[argh(option)]
    pub(super) prob_thd: Option<f32>,
    /// with SAM 3: the class id of pixels below --prob-thd (default 0, or the preset's; 255 = no data)
    #[argh(option)]
    pub(super) bg_idx: Option<u8>,
    /// with SAM 3: sliding-window inference on images larger than CROP, `CROP[:STRIDE]` pixels (STRIDE
    /// defaults to CROP; `0` turns a preset's off)
    #[argh(option)]
    pub(super) slide: Option<String>,
    /// with SAM 3: also write the per-class scores `<stem>.scores.npy` (float16, classes × H × W)
    #[argh(switch)]
    pub(super) scores: bool,
    /// also write a palette visualisation `<stem>.seg.color.png`
    #[argh(switch)]
    pub(super) palette: bool,
    /// network input size HxW (default: preprocessor_config.json, else 512x512; each side at most 8192)
    #[argh(option, from_str_fn(parse_size))]
    pub(super) size: Option<(usize, usize)>,
    /// images per forward pass: `auto` (default: planned from --mem-budget and the model's
    /// per-image estimate, halved when a pass runs out of memory) or a number from 1 to 256
    #[argh(option, default = "BatchSetting::Auto")]
    pub(super) batch: BatchSetting,
    /// memory for activations in MiB (default: what the device can spare after loading the model,
    /// less 10 %)
    #[argh(option)]
    pub(super) mem_budget: Option<u64>,
    /// images or directories of images (searched recursively)
    #[argh(positional, arg_name = "INPUTS")]
    pub(super) inputs: Vec<PathBuf>,
    /// output directory (required); a directory input's tree is mirrored under it
    #[argh(option)]
    pub(super) out: PathBuf,
    /// tiled inference, tile side in pixels: 0 = off; default: the network input size (512) for
    /// GeoTIFFs over 4096 px per side and TIFFs over the image limits, which then get only
    /// `<stem>.seg.tif` (uint8 tiled GeoTIFF; logits blended across tiles)
    #[argh(option)]
    pub(super) tile: Option<usize>,
    /// overlap between tiles in pixels (default 64, at most half the tile)
    #[argh(option)]
    pub(super) overlap: Option<usize>,
    /// stop at the first input that fails (default: report it, go on, exit 2 at the end)
    #[argh(switch)]
    pub(super) fail_fast: bool,
    /// progress display: auto (a bar on a terminal, else lines), bar, lines or none
    #[argh(option, default = "String::from(\"auto\")")]
    pub(super) progress: String,
    /// device: cpu, cuda[:N], metal or auto (default auto)
    #[argh(option, default = "String::from(\"auto\")")]
    pub(super) device: String,
    /// compute dtype: f32 (default), f16, bf16
    #[argh(option, default = "String::from(\"f32\")")]
    pub(super) dtype: String,
}

/// Largest side `--size` accepts.
const MAX_INPUT_SIDE: usize = 8192;

fn parse_size(s: &str) -> Result<(usize, usize), String> {
    let bad = || format!("`{s}` is not HxW with sides 1 to {MAX_INPUT_SIDE}");
    let (h, w) = s.split_once(['x', 'X']).ok_or_else(bad)?;
    let p = |v: &str| v.trim().parse::<usize>().ok().filter(|n| (1..=MAX_INPUT_SIDE).contains(n)).ok_or_else(bad);
    Ok((p(h)?, p(w)?))
}

/// Runs `segment`.
pub fn run(a: Args) -> anyhow::Result<()> {
    usage(!a.inputs.is_empty(), || "segment: give at least one image or directory".into())?;
    let progress = progress_mode(&a.progress)?;
    let (device, dtype) = compute(&a.device, &a.dtype)?;
    let items = collect_inputs(&a.inputs, IMAGE_SUFFIXES, Some(&a.out))?;
    if let Some(ckpt) = open_sam3(&a.model).with_context(|| format!("cannot load model {}", a.model.display()))? {
        return super::segment_open::run(a, ckpt, device, dtype, progress, items);
    }
    super::segment_open::refuse_open_vocab_flags(&a)?;
    let mut seg = Segmenter::load(&a.model, &device, dtype).with_context(|| format!("cannot load model {}", a.model.display()))?;
    if let Some(s) = a.size {
        seg.set_input_size(Some(s));
    }
    let map = match &a.classes {
        Some(p) => ClassMap::load(p, seg.labels()).with_context(|| format!("cannot use class map {}", p.display()))?,
        None => ClassMap::identity(seg.labels()).with_context(|| format!("cannot write uint8 masks for {}", a.model.display()))?,
    };
    let meta = map.metadata_json();
    let model_name = a.model.display().to_string();
    create_out_dir(&a.out)?;
    let budget = resolve_budget("segment", a.batch, a.mem_budget, &device)?;
    let state = Some(state_file(&a.out, "segment"));
    let spec = RunSpec { command: "segment", batch: a.batch, budget, device: device.clone(), fail_fast: a.fail_fast, progress, state };
    let limits = ImageLimits::default();
    let default = seg_default(&seg);
    let req = tiled::request(a.tile, a.overlap, default)?;
    let tiled_output = Output::Classes { lut: map.lut.clone(), description: Some(meta.clone()), floor: None };
    run_items(
        &spec,
        &items,
        |it| tiled::load(it, req, default, &limits),
        |l| tiled::loaded_bytes(l, |img| seg.activation_bytes(img)),
        |_, loaded| tiled::predict_images(loaded, |imgs| Ok(seg.segment(imgs)?)),
        |it, loaded, ids| {
            let (img, ids) = match (loaded, ids) {
                (Loaded::Image(img), Some(ids)) => (img, ids),
                (Loaded::Tiled(t, o), _) => {
                    let per_tile = seg.activation_bytes(&image::RgbImage::new(*t as u32, *t as u32));
                    return tiled::run(&spec, &a.out, it, ".seg.tif", &SegTiles { seg: &seg }, &tiled_output, (*t, *o), per_tile);
                }
                (Loaded::Image(_), None) => anyhow::bail!("no classes for an image (a bug)"),
            };
            write_class_map(&a.out, it, img.dimensions(), &map.apply(&ids)?, (&model_name, &meta), a.palette.then_some(&map))
        },
    )
}

/// Writes an item's `<stem>.seg.png` (class ids, with the model and class table in its metadata)
/// and, given a palette's map, `<stem>.seg.color.png`.
pub(super) fn write_class_map(out: &std::path::Path, it: &InputItem, (w, h): (u32, u32), ids: &[u8], (model, meta): (&str, &str), palette: Option<&ClassMap>) -> anyhow::Result<()> {
    let text = [("Software", "edgerun segment"), ("edgerun:model", model), ("edgerun:classes", meta)];
    write_png_gray8(&output_path(out, it, ".seg.png")?, w, h, ids, &text)?;
    if let Some(map) = palette {
        write_png_rgb8(&output_path(out, it, ".seg.color.png")?, w, h, &map.colorize(ids))?;
    }
    Ok(())
}
