//! `edgerun segment` with a SAM 3 model: open-vocabulary classes (SegEarth-OV-3) named by
//! `--classes FILE`, `--prompts`, `--preset` or the prompts a GGUF stores; `--conf`, `--prob-thd`,
//! `--bg-idx`, `--slide`; outputs as SegFormer's plus `--scores`.
use anyhow::Context;
use candle_core::{DType, Device};
use edgerun::imageio::npy::write_npy_f16;
use edgerun::imageio::ImageLimits;
use edgerun::inputs::InputItem;
use edgerun::models::Checkpoint;
use edgerun::progress::Mode;
use edgerun::tasks::open_vocab::{parse_slide, ClassList, OpenVocabSegmenter, OpenVocabSpec, Params};
use edgerun::tasks::segment::ClassMap;
use edgerun::tasks::tiles::{open_vocab_default, OpenVocabTiles};
use edgerun::tiling::Output;

use super::common::{usage, UsageError};
use super::run_inputs::{create_out_dir, output_path, resolve_budget, run_items, state_file, RunSpec};
use super::segment::{write_class_map, Args};
use super::tiled::{self, Loaded};

/// Errors for the SAM 3 flags given with another model.
pub fn refuse_open_vocab_flags(a: &Args) -> anyhow::Result<()> {
    let given = [("--prompts", a.prompts.is_some()), ("--preset", a.preset.is_some()), ("--conf", a.conf.is_some()), ("--prob-thd", a.prob_thd.is_some()), ("--bg-idx", a.bg_idx.is_some()), ("--slide", a.slide.is_some()), ("--scores", a.scores)];
    match given.iter().find(|(_, on)| *on) {
        Some((flag, _)) => Err(UsageError(format!("segment: {flag} needs a SAM 3 model; {} is not one", a.model.display())).into()),
        None => Ok(()),
    }
}

/// The classes and parameters the flags name.
fn classes_and_params(a: &Args, ckpt: &Checkpoint) -> anyhow::Result<(ClassList, Params)> {
    let slide = match &a.slide {
        Some(s) => Some(parse_slide(s).map_err(|m| UsageError(format!("--slide {m}")))?),
        None => None,
    };
    let spec = OpenVocabSpec { classes: a.classes.clone(), prompts: a.prompts.clone(), preset: a.preset.clone(), conf: a.conf, prob_thd: a.prob_thd, bg_idx: a.bg_idx, slide };
    spec.resolve(Some(ckpt.store())).map_err(|e| match e {
        edgerun::Error::Config(m) => UsageError(format!("segment: {m}")).into(),
        other => anyhow::Error::from(other),
    })
}

/// Runs `segment` with the SAM 3 checkpoint `ckpt`.
pub fn run(a: Args, ckpt: Checkpoint, device: Device, dtype: DType, progress: Mode, items: Vec<InputItem>) -> anyhow::Result<()> {
    usage(a.size.is_none(), || "segment: --size does not apply to SAM 3 (each view is resized to the model's input)".into())?;
    let (classes, params) = classes_and_params(&a, &ckpt)?;
    let seg = OpenVocabSegmenter::load(&ckpt, &device, dtype, classes, params).with_context(|| format!("cannot load model {}", a.model.display()))?;
    drop(ckpt);
    let map = ClassMap::identity(&seg.classes().names())?;
    let meta = seg.metadata_json();
    let model_name = a.model.display().to_string();
    create_out_dir(&a.out)?;
    let budget = resolve_budget("segment", a.batch, a.mem_budget, &device)?;
    let spec = RunSpec { command: "segment", batch: a.batch, budget, device: device.clone(), fail_fast: a.fail_fast, progress, state: Some(state_file(&a.out, "segment")) };
    let limits = ImageLimits::default();
    let default = open_vocab_default(&seg);
    let req = tiled::request(a.tile, a.overlap, default)?;
    let tiled_output = Output::Classes { lut: map.lut.clone(), description: Some(meta.clone()), floor: Some((params.prob_thd, params.bg_idx)) };
    run_items(
        &spec,
        &items,
        |it| tiled::load(it, req, default, &limits),
        |l| tiled::loaded_bytes(l, |img| seg.activation_bytes(img)),
        |_, loaded| tiled::predict_images(loaded, |imgs| imgs.iter().map(|img| Ok(seg.segment(img)?)).collect()),
        |it, loaded, result| {
            let (img, (ids, scores)) = match (loaded, result) {
                (Loaded::Image(img), Some(r)) => (img, r),
                (Loaded::Tiled(t, o), _) => {
                    let per_tile = seg.activation_bytes(&image::RgbImage::new(*t as u32, *t as u32));
                    return tiled::run(&spec, &a.out, it, ".seg.tif", &OpenVocabTiles { seg: &seg }, &tiled_output, (*t, *o), per_tile);
                }
                (Loaded::Image(_), None) => anyhow::bail!("no classes for an image (a bug)"),
            };
            write_class_map(&a.out, it, img.dimensions(), &ids, (&model_name, &meta), a.palette.then_some(&map))?;
            if a.scores {
                write_npy_f16(&output_path(&a.out, it, ".scores.npy")?, &[scores.classes, scores.height, scores.width], &scores.values)?;
            }
            Ok(())
        },
    )
}
