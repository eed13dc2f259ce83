//! The fine-tuning loop: micro-batches accumulated into AdamW steps on a one-cycle schedule, an EMA
//! of the weights, validation, `last/` + `best/` model directories, a JSONL log and resumable state.
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};

use super::adamw::{AdamW, AdamWConfig};
use super::outputs::{first_non_finite, load_state, save_model_dir, save_state, StateMeta};
use super::recompute::{checkpointed_step, KeptInputs, SpillFile};
use super::config::FinetuneConfig;
use super::data::{load_pixels, load_target, Augment, Dataset, Pair, SampleSpec};
use super::ema::{Ema, EmaConfig};
use super::mix::{Mix, MixConfig, Targets};
use super::sampling::{epoch_order, UNSEEN};
use super::features::FeatureCache;
use super::grads::Grads;
use super::rng::SplitMix;
use super::schedule::{OneCycle, OneCycleConfig};
use super::select::{select, TrainSpec};
use super::objective::{target_kind, trained_checkpoints, ClassOverlap, Loss};
use crate::error::{Error, Result};
use crate::fsutil::{check_dir_target, create_dir_in, lock_dir, open_in_place, recover_dir_swap, register_input, InPlace};
use crate::models::processor::processor_file;
use crate::models::training::{Features, Prediction, Trainee};
use crate::models::Checkpoint;
use crate::weights::{Trainable, Vb, WeightStore};

/// What the model reads: cached backbone features (head only) or pixels.
enum Inputs {
    Features(Features),
    Pixels(Tensor),
}

/// What a finished (or resumed-and-finished) run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Optimiser steps in the run.
    pub total_steps: usize,
    /// Steps this process took (after a resume, fewer than `total_steps`).
    pub steps_taken: usize,
    /// Trainable parameters (elements).
    pub trainable: usize,
    /// Best validation loss.
    pub best_val: Option<f64>,
    /// Wall time of the steps this process took.
    pub seconds: f64,
}

/// A loaded fine-tuning job.
struct Job {
    cfg: FinetuneConfig,
    spec: TrainSpec,
    store: Arc<WeightStore>,
    model: Box<dyn Trainee>,
    params: Vec<(String, Var)>,
    data: Dataset,
    sample: SampleSpec,
    loss: Loss,
    /// MixUp / CutMix settings.
    mix: MixConfig,
    cache: FeatureCache,
    device: Device,
    /// Files copied beside the weights in `last/` and `best/` (the model's preprocessing).
    extra_files: Vec<(&'static str, Vec<u8>)>,
    /// Samples ((validation?, index)) whose every target pixel is ignored: skipped, warned about once.
    ignored: std::collections::BTreeSet<(bool, usize)>,
    /// Targets found entirely ignored since the caller last took them (for its warning).
    newly_ignored: Vec<std::path::PathBuf>,
}

/// Runs (or resumes) the fine-tuning `cfg` describes; `note` receives progress lines.
pub fn finetune(cfg: &FinetuneConfig, device: &Device, note: &mut dyn FnMut(&str)) -> Result<Summary> {
    cfg.validate()?;
    let job = Job::load(cfg, device)?;
    job.run(note)
}

impl Job {
    fn load(cfg: &FinetuneConfig, device: &Device) -> Result<Self> {
        let task = cfg.task;
        let ckpt = Checkpoint::open(&cfg.model)?;
        let layout = ckpt.family().training().filter(|_| ckpt.serves(task)).ok_or_else(|| {
            Error::bad_file(&cfg.model, format!("task `{}` fine-tunes {}; this is `{}`", task.name(), trained_checkpoints(task), ckpt.architecture()))
        })?;
        // Inputs of the run: no output (a swapped `best/`, say) may replace them.
        register_input(&cfg.model);
        register_input(&cfg.data);
        let store = ckpt.store().clone();
        let spec = cfg.train;
        let names: Vec<String> = store.entries().keys().cloned().collect();
        let chosen = select(&layout, spec, &names)?;
        let trainable = Trainable::new(move |n| chosen.contains(n));
        let vb = Vb::new(store.clone(), DType::F32, device.clone()).with_trainable(trainable.clone());
        let model = ckpt.trainee(&vb)?;
        let params = trainable.vars();
        if params.is_empty() {
            return Err(Error::Config(format!("train = `{}` trains no parameter that the model uses", spec.name())));
        }
        if (cfg.checkpoint_activations || cfg.offload) && model.block_walk().is_none() && spec != TrainSpec::Head {
            return Err(Error::Config(format!("checkpoint_activations / offload: supported for the ViT backbones of tasks `depth` and `chm`; not yet for `{}`", task.name())));
        }
        let p = model.input_multiple();
        let [h, w] = cfg.input_size;
        if h % p != 0 || w % p != 0 {
            return Err(Error::Config(format!("input_size [{h}, {w}]: each side must be a multiple of the patch size {p}")));
        }
        let data = Dataset::open(&cfg.data, cfg.val_fraction, target_kind(task))?;
        if data.train.is_empty() {
            return Err(Error::bad_file(&cfg.data, "no training images left after the validation split"));
        }
        let loss = Loss::choose(cfg.loss.as_deref(), model.prediction(), cfg.ignore_index, cfg.focal_gamma, cfg.label_smoothing);
        let mix = cfg.mix();
        let cache_bytes = if spec == TrainSpec::Head && !cfg.augment && !mix.enabled() { cfg.feature_cache_mib << 20 } else { 0 };
        let processor = ckpt.processor()?.ok_or_else(|| Error::Config(format!("`{}` takes no images", ckpt.architecture())))?;
        let n = processor.normalization()?;
        let sample = SampleSpec { size: (h, w), mean: n.mean, std: n.std, filter: n.filter, target: target_kind(task) };
        drop(ckpt);
        let extra_files = preprocessor_file(&cfg.model)?.map(|b| vec![("preprocessor_config.json", b)]).unwrap_or_default();
        Ok(Job { cfg: cfg.clone(), spec, store, model, params, data, sample, loss, mix, cache: FeatureCache::new(cache_bytes), device: device.clone(), extra_files, ignored: Default::default(), newly_ignored: Vec::new() })
    }

    fn micro_per_epoch(&self) -> usize {
        self.data.train.len().div_ceil(self.cfg.batch)
    }

    fn steps_per_epoch(&self) -> usize {
        self.micro_per_epoch().div_ceil(self.cfg.accumulate)
    }

    /// Model inputs and targets of `pairs` ((validation?, index)), augmented and mixed when training
    /// asks, and the positions in `pairs` of the samples they hold; None when every sample's target
    /// is entirely ignored. A sample whose every target pixel is ignored (legal input: an all-NaN
    /// depth map, a class map of the ignore index only) is left out and recorded in `ignored`; the
    /// others are mixed among themselves (a mix that leaves no counted pixel gives None). An image
    /// whose frozen-backbone features are cached is not decoded again; only its target is read.
    fn inputs(&mut self, pairs: &[(bool, usize)], augment: &[Option<Augment>], mix: Mix) -> Result<Option<(Inputs, Targets, Vec<usize>)>> {
        let mixing = mix != Mix::None;
        let mut kept = Vec::with_capacity(pairs.len());
        let mut pixels = Vec::with_capacity(pairs.len());
        let mut targets = Vec::with_capacity(pairs.len());
        let mut feats = Vec::with_capacity(pairs.len());
        for (pos, (&(val, i), aug)) in pairs.iter().zip(augment).enumerate() {
            let pair: &Pair = if val { &self.data.val[i] } else { &self.data.train[i] };
            if self.ignored.contains(&(val, i)) {
                continue;
            }
            let target = load_target(pair, &self.sample, *aug, &self.device)?;
            self.check_classes(pair, &target)?;
            if !self.loss.counts_any(&target)? {
                self.ignored.insert((val, i));
                self.newly_ignored.push(pair.target.clone());
                continue;
            }
            targets.push(target);
            kept.push(pos);
            if mixing {
                // Mixed before the backbone: every image is decoded and nothing is cached.
                pixels.push(load_pixels(pair, &self.sample, *aug, &self.device)?);
            } else if self.spec == TrainSpec::Head {
                let key = (val, i);
                let f = match self.cache.get(key) {
                    Some(f) => f,
                    None => {
                        let x = load_pixels(pair, &self.sample, *aug, &self.device)?;
                        let f = self.model.features(&x.unsqueeze(0)?)?;
                        if aug.is_none() {
                            self.cache.insert(key, &f);
                        }
                        f
                    }
                };
                feats.push(f);
            } else {
                pixels.push(load_pixels(pair, &self.sample, *aug, &self.device)?);
            }
        }
        if targets.is_empty() {
            return Ok(None);
        }
        let targets = mix.targets(&Tensor::stack(&targets, 0)?, self.loss.target_rule())?;
        if let Targets::One(t) = &targets {
            if mixing && !self.loss.counts_any(t)? {
                return Ok(None);
            }
        }
        if mixing {
            let x = mix.images(&Tensor::stack(&pixels, 0)?)?;
            let inputs = if self.spec == TrainSpec::Head {
                let feats = (0..x.dim(0)?).map(|b| self.model.features(&x.narrow(0, b, 1)?)).collect::<Result<Vec<_>>>()?;
                let refs: Vec<&_> = feats.iter().collect();
                Inputs::Features(Features::stack(&refs)?)
            } else {
                Inputs::Pixels(x)
            };
            return Ok(Some((inputs, targets, kept)));
        }
        let inputs = if self.spec == TrainSpec::Head {
            let refs: Vec<&_> = feats.iter().collect();
            Inputs::Features(Features::stack(&refs)?)
        } else {
            Inputs::Pixels(Tensor::stack(&pixels, 0)?)
        };
        Ok(Some((inputs, targets, kept)))
    }

    /// Warns once about each target found entirely ignored, and refuses a training split left with
    /// nothing to learn from.
    fn report_ignored(&mut self, note: &mut dyn FnMut(&str)) -> Result<()> {
        for t in self.newly_ignored.drain(..) {
            note(&format!("warning: {}: every target pixel is ignored (NaN, infinite, out of range or the ignore index): sample skipped", t.display()));
        }
        let train_ignored = self.ignored.iter().filter(|(val, _)| !val).count();
        if train_ignored == self.data.train.len() {
            return Err(Error::bad_file(&self.cfg.data, "every training target is entirely ignored: nothing to learn from"));
        }
        Ok(())
    }

    /// A class map may only hold the model's classes and the ignore index.
    fn check_classes(&self, pair: &Pair, target: &Tensor) -> Result<()> {
        let (Prediction::Classes { classes, .. }, Loss::CrossEntropy { ignore, .. } | Loss::Focal { ignore, .. }) = (self.model.prediction(), self.loss) else {
            return Ok(());
        };
        let values = target.flatten_all()?.to_vec1::<f32>()?;
        if let Some(&v) = values.iter().find(|&&v| v as usize >= classes && v as u32 != ignore) {
            return Err(Error::bad_file(&pair.target, format!("class id {v} is not one of the model's {classes} classes (0..={}) nor the ignore index {ignore}", classes - 1)));
        }
        Ok(())
    }

    fn predict(&self, inputs: &Inputs) -> Result<Tensor> {
        match inputs {
            Inputs::Features(f) => self.model.decode(f),
            Inputs::Pixels(p) => self.model.forward(p),
        }
    }

    /// The first backbone block that trains (the block count when none does).
    fn first_trained_block(&self) -> usize {
        let n = self.model.block_walk().map_or(0, |w| w.block_count());
        match self.spec {
            TrainSpec::Head => n,
            TrainSpec::Last(k) => n.saturating_sub(k),
            TrainSpec::All => 0,
        }
    }

    fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.params.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect()
    }

    /// Mean validation loss and, for segmentation, the mean IoU (EMA weights swapped in when there is an EMA).
    fn validate(&mut self, ema: Option<&Ema>, note: &mut dyn FnMut(&str)) -> Result<Option<(f64, Option<f64>)>> {
        if self.data.val.is_empty() {
            return Ok(None);
        }
        let live: Vec<Tensor> = self.params.iter().map(|(_, v)| v.as_tensor().copy()).collect::<candle_core::Result<_>>()?;
        if let Some(ema) = ema {
            set_vars(&self.params, &ema.tensors().iter().map(|(_, t)| t.clone()).collect::<Vec<_>>())?;
        }
        let n = self.data.val.len();
        let (mut total, mut counted) = (0.0, 0usize);
        let mut overlap = ClassOverlap::default();
        let mut result = Ok(());
        for start in (0..n).step_by(self.cfg.batch) {
            let idx: Vec<(bool, usize)> = (start..(start + self.cfg.batch).min(n)).map(|i| (true, i)).collect();
            let r = self.inputs(&idx, &vec![None; idx.len()], Mix::None).and_then(|batch| {
                let Some((x, t, kept)) = batch else { return Ok(None) };
                let pred = self.predict(&x)?.detach();
                if let (Some(ignore), Targets::One(t)) = (self.loss.ignore_index(), &t) {
                    overlap.add(&pred, t, ignore)?;
                }
                let l = self.loss.apply_targets(&pred, &t)?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                Ok(Some((l, kept.len())))
            });
            match r {
                Ok(Some((l, used))) => {
                    total += l * used as f64;
                    counted += used;
                }
                Ok(None) => {}
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        set_vars(&self.params, &live)?;
        result?;
        for t in self.newly_ignored.drain(..) {
            note(&format!("warning: {}: every target pixel is ignored: validation sample skipped", t.display()));
        }
        // A validation split whose every target is ignored measures nothing: as if there were none.
        Ok((counted > 0).then(|| (total / counted as f64, overlap.mean_iou())))
    }

    fn extra(&self) -> Vec<(&'static str, &[u8])> {
        self.extra_files.iter().map(|(n, b)| (*n, b.as_slice())).collect()
    }

    /// The weights the outputs carry: the EMA's when there is one.
    fn output_weights(&self, ema: Option<&Ema>) -> HashMap<String, Tensor> {
        match ema {
            Some(e) => e.tensors().iter().cloned().collect(),
            None => self.named_tensors().into_iter().collect(),
        }
    }

    fn run(mut self, note: &mut dyn FnMut(&str)) -> Result<Summary> {
        let out = self.cfg.out.clone();
        // One run per output directory; every refusal about the outputs comes before any step.
        let _lock = lock_dir(&out, "finetune")?;
        create_dir_in(&out, &out.join("state"))?;
        for d in ["last", "best"] {
            recover_dir_swap(&out.join(d))?;
            check_dir_target(&out.join(d))?;
        }
        let total = self.cfg.epochs.checked_mul(self.steps_per_epoch()).ok_or_else(|| Error::Config("epochs × steps per epoch overflows".into()))?;
        let sched = OneCycle::new(OneCycleConfig {
            max_lr: self.cfg.max_lr,
            total_steps: total,
            pct_start: self.cfg.pct_start,
            div_factor: self.cfg.div_factor,
            final_div_factor: self.cfg.final_div_factor,
            cycle_momentum: self.cfg.cycle_momentum,
            ..Default::default()
        })?;
        let mut adam = AdamW::new(self.params.clone(), AdamWConfig { lr: sched.lr(0)?, weight_decay: self.cfg.weight_decay, ..Default::default() })?;
        let ema_cfg = EmaConfig { decay: self.cfg.ema_decay, use_warmup: self.cfg.ema_warmup, ..Default::default() };
        let mut ema = if self.cfg.ema_decay > 0.0 { Some(Ema::new(&self.named_tensors(), ema_cfg)?) } else { None };
        let state_path = out.join("state").join("state.safetensors");
        let log_path = out.join("log.jsonl");
        let fingerprint = self.cfg.fingerprint();
        let (mut step, mut best_val) = (0usize, None::<f64>);
        let mut log = open_in_place(&out, &log_path, InPlace::Append)?;
        // Hard-example sampling: each training sample's latest loss, and the copy the current
        // epoch's order was drawn from (both saved in the state).
        let n_train = self.data.train.len();
        let mut hard = (self.cfg.hard_examples > 0.0).then(|| HardLosses { latest: vec![UNSEEN; n_train], epoch: vec![UNSEEN; n_train] });
        if std::fs::symlink_metadata(&state_path).is_ok() {
            let (tensors, meta) = load_state(&state_path, &self.device)?;
            meta.check(&state_path, total, &fingerprint)?;
            let take = |prefix: &str| -> HashMap<String, Tensor> {
                tensors.iter().filter_map(|(k, t)| k.strip_prefix(prefix).map(|n| (n.to_string(), t.clone()))).collect()
            };
            let params = take("param.");
            let values = self
                .params
                .iter()
                .map(|(n, _)| params.get(n).cloned().ok_or_else(|| Error::bad_tensor(&state_path, format!("param.{n}"), "missing")))
                .collect::<Result<Vec<_>>>()?;
            let in_state = |e: Error| Error::bad_file(&state_path, e.to_string());
            set_vars(&self.params, &values).map_err(in_state)?;
            adam.load_state(&take("adam."), meta.adam_steps).map_err(in_state)?;
            if let Some(e) = ema.as_mut() {
                e.load(&take("ema.")).map_err(in_state)?;
            }
            if let Some(h) = hard.as_mut() {
                *h = HardLosses::from_state(&tensors, n_train).map_err(|m| Error::bad_file(&state_path, m))?;
            }
            step = meta.step;
            best_val = meta.best_val;
            cut_log(&log, &log_path, meta.log_len, note)?;
            note(&format!("resuming at step {step} of {total}"));
        } else {
            cut_log(&log, &log_path, 0, note)?;
        }
        let trainable: usize = self.params.iter().map(|(_, v)| v.elem_count()).sum();
        note(&format!(
            "{} trainable tensors ({trainable} values), {} training / {} validation images, {total} steps of {} × {}",
            self.params.len(),
            self.data.train.len(),
            self.data.val.len(),
            self.cfg.batch,
            self.cfg.accumulate
        ));
        let mut curve = validation_curve(&mut log, &log_path)?;
        let started = Instant::now();
        let first = step;
        let mut grads = Grads::new(&self.params);
        let spill = out.join("state").join("activations.spill");
        let mut kept = match (self.cfg.checkpoint_activations || self.cfg.offload, self.cfg.offload) {
            _ if self.spec == TrainSpec::Head => None,
            (false, _) => None,
            (true, false) => Some(KeptInputs::Device(HashMap::new())),
            (true, true) if self.device.is_cpu() => Some(KeptInputs::Spill(SpillFile::create(&out, &spill)?)),
            (true, true) => Some(KeptInputs::Host(HashMap::new(), self.device.clone())),
        };
        while step < total {
            let (epoch, in_epoch) = (step / self.steps_per_epoch(), step % self.steps_per_epoch());
            if let (Some(h), 0) = (hard.as_mut(), in_epoch) {
                h.epoch.clone_from(&h.latest);
            }
            let order = epoch_order(&mut SplitMix::keyed(&[self.cfg.seed, epoch as u64]), n_train, hard.as_ref().map(|h| h.epoch.as_slice()), self.cfg.hard_examples);
            let micro_lo = in_epoch * self.cfg.accumulate;
            let micro_hi = (micro_lo + self.cfg.accumulate).min(self.micro_per_epoch());
            let k = micro_hi - micro_lo;
            let (mut loss_sum, mut used) = (0.0, 0usize);
            for m in micro_lo..micro_hi {
                let idx: Vec<(bool, usize)> = order[m * self.cfg.batch..((m + 1) * self.cfg.batch).min(order.len())].iter().map(|&i| (false, i)).collect();
                let augs: Vec<Option<Augment>> = idx
                    .iter()
                    .map(|&(_, i)| self.cfg.augment.then(|| Augment::draw(&mut SplitMix::keyed(&[self.cfg.seed, epoch as u64, i as u64, 1]))))
                    .collect();
                let (h, w) = self.sample.size;
                let mix = self.mix.draw(&mut SplitMix::keyed(&[self.cfg.seed, epoch as u64, m as u64, 2]), h, w);
                let batch = crate::profile::tally("step: inputs (decode, features)", || self.inputs(&idx, &augs, mix))?;
                self.report_ignored(note)?;
                // Left out: its contribution to the step is zero (the others stay divided by k).
                let Some((inputs, target, kept_pos)) = batch else { continue };
                let per_sample = std::cell::RefCell::new(Vec::new());
                let value = match (&mut kept, &inputs) {
                    (Some(kept), Inputs::Pixels(pixels)) => {
                        let loss_fn = |pred: &Tensor| -> Result<Tensor> {
                            if hard.is_some() {
                                *per_sample.borrow_mut() = self.loss.per_sample(pred, &target)?;
                            }
                            Ok((self.loss.apply_targets(pred, &target)? / k as f64)?)
                        };
                        let model = self.model.block_walk().ok_or_else(|| Error::Config("activation checkpointing needs a ViT backbone".into()))?;
                        checkpointed_step(model, pixels, self.first_trained_block(), kept, &mut grads, &loss_fn)? * k as f64
                    }
                    _ => {
                        let pred = crate::profile::tally("step: forward", || self.predict(&inputs))?;
                        if hard.is_some() {
                            *per_sample.borrow_mut() = self.loss.per_sample(&pred, &target)?;
                        }
                        let loss = crate::profile::tally("step: loss", || self.loss.apply_targets(&pred, &target))?;
                        let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                        if value.is_finite() {
                            let store = crate::profile::tally("step: backward (every op)", || (loss / k as f64)?.backward())?;
                            crate::profile::tally("step: gradient sums", || grads.accumulate(&store))?;
                        }
                        value
                    }
                };
                if let Some(h) = hard.as_mut() {
                    for (&pos, v) in kept_pos.iter().zip(per_sample.into_inner()) {
                        if let Some(v) = v {
                            h.latest[idx[pos].1] = v as f32;
                        }
                    }
                }
                if !value.is_finite() {
                    return Err(Error::Input(format!("the loss is {value} at step {step} (images {}); nothing was saved over the last checkpoint", names(&self.data.train, &idx))));
                }
                loss_sum += value;
                used += 1;
            }
            let lr = sched.lr(step)?;
            adam.set_lr(lr);
            if let Some(beta1) = sched.momentum(step)? {
                adam.set_beta1(beta1);
            }
            // A step whose every sample was left out has no gradient: the weights stay as they are.
            let grad_norm = if self.cfg.clip_grad_norm > 0.0 && used > 0 { Some(grads.clip_norm(self.cfg.clip_grad_norm)?) } else { None };
            if used > 0 {
                crate::profile::tally("step: AdamW", || adam.step(&grads))?;
            }
            grads.clear();
            if inject_nan_at() == Some(step + 1) {
                let (_, v) = &self.params[0];
                v.set(&(v.as_tensor() * f64::NAN)?)?;
            }
            let params = self.named_tensors();
            if let Some(name) = crate::profile::tally("step: finiteness check", || first_non_finite(params.iter().map(|(n, t)| (n.as_str(), t))))? {
                return Err(Error::Input(format!(
                    "step {} turned `{name}` non-finite (NaN or infinite; try a lower max_lr or clip_grad_norm); nothing was saved over the last checkpoint",
                    step + 1
                )));
            }
            step += 1;
            if let Some(e) = ema.as_mut() {
                crate::profile::tally("step: EMA", || e.update(&params, step as u64))?;
            }
            crate::profile::print_tallies(&format!("training step {step}/{total}"));
            // null in the log when every micro-batch of the step was left out.
            let loss = (used > 0).then(|| loss_sum / used as f64);
            write_line(&mut log, &log_path, serde_json::json!({"step": step, "lr": lr, "loss": loss, "grad_norm": grad_norm}))?;
            let epoch_end = self.cfg.val_every_epoch && step % self.steps_per_epoch() == 0;
            if step % self.cfg.val_every == 0 || step == total || epoch_end {
                if let Some((v, miou)) = self.validate(ema.as_ref(), note)? {
                    let mut line = serde_json::json!({"step": step, "val_loss": v});
                    let shown = loss.map_or_else(|| "- (every sample ignored)".to_string(), |l| format!("{l:.5}"));
                    let mut msg = format!("step {step}/{total}: loss {shown}, val_loss {v:.5}");
                    if let Some(m) = miou {
                        line["val_miou"] = serde_json::json!(m);
                        msg.push_str(&format!(", val_miou {m:.4}"));
                    }
                    write_line(&mut log, &log_path, line)?;
                    curve.push((step, v, miou));
                    note(&msg);
                    if best_val.is_none_or(|b| v < b) {
                        best_val = Some(v);
                        save_model_dir(&self.store, &self.output_weights(ema.as_ref()), &self.extra(), &out.join("best"))?;
                    }
                }
            }
            if step % self.cfg.save_every == 0 || step == total {
                save_model_dir(&self.store, &self.output_weights(ema.as_ref()), &self.extra(), &out.join("last"))?;
                let mut tensors: Vec<(String, Tensor)> = self.named_tensors().into_iter().map(|(n, t)| (format!("param.{n}"), t)).collect();
                tensors.extend(adam.state().into_iter().map(|(n, t)| (format!("adam.{n}"), t)));
                if let Some(e) = ema.as_ref() {
                    tensors.extend(e.tensors().iter().map(|(n, t)| (format!("ema.{n}"), t.clone())));
                }
                if let Some(h) = hard.as_ref() {
                    tensors.extend(h.tensors()?);
                }
                let log_len = log.metadata().map_err(|e| Error::io(&log_path, e))?.len();
                let meta = StateMeta { step, adam_steps: adam.step_count(), best_val, log_len, fingerprint: fingerprint.clone() };
                save_state(&state_path, &tensors, &meta)?;
            }
        }
        drop(kept);
        if spill.exists() {
            std::fs::remove_file(&spill).map_err(|e| Error::io(&spill, e))?;
        }
        if !out.join("best").exists() {
            // No validation split: the last weights are the best known.
            save_model_dir(&self.store, &self.output_weights(ema.as_ref()), &self.extra(), &out.join("best"))?;
        }
        for line in curve_tail(&curve, CURVE_TAIL) {
            note(&line);
        }
        Ok(Summary { total_steps: total, steps_taken: step - first, trainable, best_val, seconds: started.elapsed().as_secs_f64() })
    }
}

/// Validation points printed at the end of a run.
const CURVE_TAIL: usize = 5;

/// Hard-example sampling's per-sample training losses ([`UNSEEN`] where not known yet).
struct HardLosses {
    /// Each sample's latest loss.
    latest: Vec<f32>,
    /// The losses the current epoch's order was drawn from.
    epoch: Vec<f32>,
}

impl HardLosses {
    /// The state's `hard.latest` and `hard.epoch` (each `[n]`, values ≥ 0 or −1).
    fn from_state(tensors: &HashMap<String, Tensor>, n: usize) -> std::result::Result<Self, String> {
        let take = |name: &str| -> std::result::Result<Vec<f32>, String> {
            let t = tensors.get(name).ok_or_else(|| format!("no `{name}`: saved without hard_examples or altered; delete it to start over"))?;
            let v = t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(|e| e.to_string())?;
            if v.len() != n || v.iter().any(|&l| l != UNSEEN && l < 0.0) {
                return Err(format!("`{name}` does not hold {n} per-sample losses (≥ 0, or −1 for unseen): altered; delete it to start over"));
            }
            Ok(v)
        };
        Ok(HardLosses { latest: take("hard.latest")?, epoch: take("hard.epoch")? })
    }

    /// The state's tensors.
    fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let t = |v: &[f32]| Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu);
        Ok(vec![("hard.latest".into(), t(&self.latest)?), ("hard.epoch".into(), t(&self.epoch)?)])
    }
}

/// The validation points (step, loss, mIoU) already in `log.jsonl` (a resumed run's earlier ones).
fn validation_curve(log: &mut std::fs::File, path: &Path) -> Result<Vec<(usize, f64, Option<f64>)>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut bytes = Vec::new();
    log.seek(SeekFrom::Start(0)).and_then(|_| log.read_to_end(&mut bytes)).map_err(|e| Error::io(path, e))?;
    Ok(String::from_utf8_lossy(&bytes)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["step"].as_u64()? as usize, v["val_loss"].as_f64()?, v["val_miou"].as_f64())))
        .collect())
}

/// The last `n` points of the validation curve, one line each.
fn curve_tail(curve: &[(usize, f64, Option<f64>)], n: usize) -> Vec<String> {
    if curve.is_empty() {
        return Vec::new();
    }
    let mut lines = vec![format!("validation curve (last {} of {} points):", n.min(curve.len()), curve.len())];
    for &(step, v, miou) in &curve[curve.len().saturating_sub(n)..] {
        let m = miou.map(|m| format!("  val_miou {m:.4}")).unwrap_or_default();
        lines.push(format!("  step {step:>6}  val_loss {v:.5}{m}"));
    }
    lines
}

/// Test hook: with `EDGERUN_INJECT_NAN_AT_STEP=N`, optimiser step N turns the first trained tensor
/// into NaN (as a diverging step does), so the refusal to save it can be tested end to end.
fn inject_nan_at() -> Option<usize> {
    static AT: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *AT.get_or_init(|| std::env::var("EDGERUN_INJECT_NAN_AT_STEP").ok().and_then(|v| v.trim().parse().ok()))
}

/// `preprocessor_config.json` beside the model, copied into the outputs.
fn preprocessor_file(model: &Path) -> Result<Option<Vec<u8>>> {
    processor_file(model).map(|p| crate::fsutil::read_input(&p, crate::fsutil::MAX_TEXT_INPUT)).transpose()
}

fn names(pairs: &[Pair], idx: &[(bool, usize)]) -> String {
    idx.iter().map(|&(_, i)| pairs[i].name.as_str()).collect::<Vec<_>>().join(", ")
}

fn set_vars(params: &[(String, Var)], values: &[Tensor]) -> Result<()> {
    for ((name, var), t) in params.iter().zip(values) {
        if t.dims() != var.dims() {
            return Err(Error::Input(format!("parameter `{name}`: shape {:?}, expected {:?}", t.dims(), var.dims())));
        }
        var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
    }
    Ok(())
}

fn write_line(log: &mut std::fs::File, path: &Path, v: serde_json::Value) -> Result<()> {
    writeln!(log, "{v}").and_then(|()| log.flush()).map_err(|e| Error::io(path, e))
}

/// Cuts `log.jsonl` back to `len` bytes (lines written after the state being resumed are replayed).
/// Never lengthens it: a log shorter than the state says (deleted, truncated, or a length altered)
/// is kept as it is, with a warning.
fn cut_log(log: &std::fs::File, path: &Path, len: u64, note: &mut dyn FnMut(&str)) -> Result<()> {
    let now = log.metadata().map_err(|e| Error::io(path, e))?.len();
    if now < len {
        note(&format!("warning: {}: {now} bytes, shorter than the {len} the state recorded (deleted or cut?); new lines follow what is there", path.display()));
        return Ok(());
    }
    log.set_len(len).map_err(|e| Error::io(path, e))
}
