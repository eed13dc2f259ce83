//! The pipeline: a bounded pool of decode threads reading batches ahead (prefetch), one inference
//! thread running the stages' models on whole batches, a bounded pool of writer threads, and a journal
//! thread that records each finished item once its outputs are durable. A byte budget bounds the
//! decoded images and results in flight; the writer queue decouples the model from the disk.
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use image::RgbImage;

use super::config::{Config, FloatFormat, StageKind};
use super::decode;
use super::journal::{unix_ms, Journal, Record, Status};
use super::layout::{output_rel, OutputKind};
use super::listing::InputFile;
use super::summary::{Failure, StageSummary};
use crate::progress::Progress;
use super::stages::{Devices, ModelChain, Prediction};
use crate::edges::sobel_magnitude;
use crate::geotiff::{write_f32 as write_geotiff_f32, GeoReference};
use crate::error::{Error, Result};
use crate::imageio::colormap::colorize;
use crate::imageio::npy::write_npy_f32;
use crate::imageio::{write_npy_f16, write_png_gray8, write_png_rgb8};

/// A set of stages (bit i = `StageKind::ALL[i]`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StageSet(u8);

fn bit(k: StageKind) -> u8 {
    1 << (k as u8)
}

impl StageSet {
    /// Adds a stage.
    pub(crate) fn insert(&mut self, k: StageKind) {
        self.0 |= bit(k);
    }
    /// Whether the stage is in the set.
    pub(crate) fn has(self, k: StageKind) -> bool {
        self.0 & bit(k) != 0
    }
    /// Number of stages.
    pub(crate) fn len(self) -> usize {
        self.0.count_ones() as usize
    }
    /// Whether empty.
    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// The stages, in pipeline order.
    pub(crate) fn iter(self) -> impl Iterator<Item = StageKind> {
        StageKind::ALL.into_iter().filter(move |k| self.has(*k))
    }
    /// Union.
    pub(crate) fn union(self, o: StageSet) -> StageSet {
        StageSet(self.0 | o.0)
    }
}

/// An input of the run.
#[derive(Debug, Clone)]
pub(crate) struct ItemInfo {
    /// Listing entry.
    pub file: InputFile,
    /// Relative path without extension.
    pub stem: String,
}

impl ItemInfo {
    fn hash_hex(&self) -> Option<String> {
        self.file.hash.map(|h| format!("xxh64:{h:016x}"))
    }
}

/// One batch member.
#[derive(Debug, Clone)]
pub(crate) struct Member {
    /// Index into the items.
    pub item: usize,
    /// Stages still to record for this item.
    pub pending: StageSet,
    /// Whether the image must be decoded (a model runs on the batch).
    pub decode: bool,
    /// Whether edges read the existing depth map from disk.
    pub read_depth: bool,
    /// A reason known before reading (an output-name collision).
    pub pre_failed: Option<String>,
    /// Stages whose passes leave this member out (it was killed for memory there, twice alone).
    pub left_out: StageSet,
}

/// One batch: consecutive items of the sorted list; the model stages it runs.
#[derive(Debug, Clone)]
pub(crate) struct ChunkJob {
    /// Members in list order.
    pub members: Vec<Member>,
    /// Model stages run on the whole batch.
    pub run: StageSet,
}

/// Everything the pipeline needs.
pub(crate) struct Exec<'a> {
    /// The configuration.
    pub cfg: &'a Config,
    /// The input root.
    pub input_root: &'a Path,
    /// The output root.
    pub output: &'a Path,
    /// All items of the list.
    pub items: &'a [ItemInfo],
    /// This shard's batches with pending work.
    pub jobs: Vec<ChunkJob>,
    /// Model chains by stage (only stages some batch runs).
    pub chains: &'a mut [ModelChain],
    /// Devices.
    pub devices: &'a mut Devices,
    /// Open journals by stage.
    pub journals: &'a mut HashMap<StageKind, Journal>,
    /// `K/N`.
    pub shard: String,
    /// Progress display.
    pub progress: Progress,
    /// List when each (item, stage) record was written ([`ExecStats::recorded`]).
    pub track: bool,
}

/// The read-only part of [`Exec`] the worker threads share.
struct View<'a> {
    cfg: &'a Config,
    input_root: &'a Path,
    output: &'a Path,
    items: &'a [ItemInfo],
    jobs: &'a [ChunkJob],
    shard: &'a str,
}

/// What the pipeline measured.
#[derive(Debug, Default)]
pub(crate) struct ExecStats {
    /// Per stage (done, failed, model_s, write_s, by_model filled).
    pub stages: HashMap<StageKind, StageSummary>,
    /// Items with a failed stage.
    pub failed_items: BTreeSet<usize>,
    /// Seconds from start to the last record.
    pub pipeline_s: f64,
    /// Sum of model seconds.
    pub model_busy_s: f64,
    /// Inference waiting for decoded batches.
    pub wait_input_s: f64,
    /// Inference waiting for writer capacity.
    pub wait_output_s: f64,
    /// Read + decode seconds over decode threads.
    pub decode_s: f64,
    /// Failures (capped).
    pub failures: Vec<Failure>,
    /// When each (item, stage) record was written and whether ok (only when tracked).
    pub recorded: Vec<(usize, StageKind, Instant, bool)>,
}

const MAX_FAILURES_LISTED: usize = 1000;

// ---------------------------------------------------------------------------------------------
// Memory budget

struct Budget {
    limit: u64,
    used: Mutex<u64>,
    cv: Condvar,
}

struct Permit {
    budget: Arc<Budget>,
    n: u64,
}

impl Budget {
    /// Blocks until `n` bytes fit (a request always succeeds when nothing else is held, so one
    /// oversized batch cannot deadlock); `None` when aborting.
    fn acquire(self: &Arc<Self>, n: u64, abort: &AtomicBool) -> Option<Permit> {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        while *used > 0 && used.saturating_add(n) > self.limit {
            if abort.load(Ordering::Relaxed) {
                return None;
            }
            used = self.cv.wait_timeout(used, Duration::from_millis(100)).unwrap_or_else(|p| p.into_inner()).0;
        }
        *used += n;
        Some(Permit { budget: self.clone(), n })
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock().unwrap_or_else(|p| p.into_inner());
        *used = used.saturating_sub(self.n);
        self.budget.cv.notify_all();
    }
}

// ---------------------------------------------------------------------------------------------
// Messages

struct LoadedItem {
    member: Member,
    image: Option<std::result::Result<RgbImage, String>>,
    depth: Option<std::result::Result<DepthData, String>>,
    /// The input's georeferencing (CHM GeoTIFF output), when read.
    geo: Option<std::result::Result<Option<Arc<GeoReference>>, String>>,
}

#[derive(Clone)]
struct DepthData {
    h: usize,
    w: usize,
    values: Arc<Vec<f32>>,
}

struct LoadedChunk {
    items: Vec<LoadedItem>,
    permit: Arc<Permit>,
}

enum Payload {
    Float { h: usize, w: usize, values: Arc<Vec<f32>>, geotiff: Option<(Vec<f32>, Arc<GeoReference>)> },
    Edges(DepthData),
    Classes { h: usize, w: usize, ids: Vec<u8>, classes: Arc<super::stages::ClassInfo> },
}

struct WriteJob {
    item: usize,
    stage: StageKind,
    model: Option<String>,
    payload: Payload,
    _permit: Arc<Permit>,
}

struct JMsg {
    item: usize,
    stage: StageKind,
    record: Record,
}

/// Shared state of the worker threads.
struct Shared {
    abort: AtomicBool,
    fatal: Mutex<Option<Error>>,
    write_s: Mutex<HashMap<StageKind, f64>>,
    decode_s: Mutex<f64>,
}

impl Shared {
    fn fail(&self, e: Error) {
        let mut f = self.fatal.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            *f = Some(e);
        }
        self.abort.store(true, Ordering::SeqCst);
    }
}

/// A journal record of `item`.
pub(super) fn record(items: &[ItemInfo], shard: &str, item: usize, status: Status, model: Option<String>, outputs: Vec<String>, reason: Option<String>) -> Record {
    let it = &items[item];
    Record {
        input: it.file.rel.clone(),
        size: it.file.size,
        mtime_ns: it.file.mtime_ns,
        hash: it.hash_hex(),
        status,
        model,
        outputs,
        reason,
        shard: shard.to_string(),
        unix_ms: unix_ms(),
    }
}

/// Rounds values the way the depth file stores them, so edges computed in memory equal edges
/// computed from the file.
fn as_stored(values: Vec<f32>, f: FloatFormat) -> Vec<f32> {
    match f {
        FloatFormat::F32 => values,
        FloatFormat::F16 => values.into_iter().map(|v| half::f16::from_f32(v).to_f32()).collect(),
    }
}

/// Heights for the GeoTIFF: pixels whose source is the nodata value in every band become nodata
/// (8-bit sources with an integral nodata in 0..=255), as `edgerun chm` writes them.
fn nodata_masked(values: &[f32], img: &RgbImage, geo: &GeoReference) -> Vec<f32> {
    let mut out = values.to_vec();
    let Some(nd) = geo.nodata() else { return out };
    if geo.bits_per_sample != 8 || nd.fract() != 0.0 || !(0.0..=255.0).contains(&nd) {
        return out;
    }
    let v = nd as u8;
    for (o, px) in out.iter_mut().zip(img.pixels()) {
        if px.0 == [v, v, v] {
            *o = nd as f32;
        }
    }
    out
}

/// Bytes in flight per pixel of an input (decoded RGB plus the stages' maps and encodings).
fn bytes_per_pixel(cfg: &Config) -> u64 {
    let stages = cfg.stage_list();
    3 + 10 * stages.len() as u64 + 3 * stages.iter().filter(|k| cfg.visualize(**k)).count() as u64
}

// ---------------------------------------------------------------------------------------------
// Decode

fn decode_chunk(x: &View<'_>, job: &ChunkJob, budget: &Arc<Budget>, abort: &AtomicBool) -> Option<LoadedChunk> {
    let limits = x.cfg.image_limits();
    let bpp = bytes_per_pixel(x.cfg);
    let mut encoded: Vec<Option<std::result::Result<decode::Encoded, String>>> = Vec::with_capacity(job.members.len());
    let mut depths: Vec<Option<std::result::Result<DepthData, String>>> = Vec::with_capacity(job.members.len());
    let mut geos = Vec::with_capacity(job.members.len());
    let mut est: u64 = 0;
    for m in &job.members {
        let it = &x.items[m.item];
        let e = (m.decode && m.pre_failed.is_none()).then(|| decode::read_checked(&x.input_root.join(&it.file.rel), &limits));
        if let Some(Ok(enc)) = &e {
            est += enc.bytes.len() as u64 + enc.width as u64 * enc.height as u64 * bpp;
        }
        encoded.push(e);
        let d = (m.read_depth && m.pre_failed.is_none()).then(|| {
            let rel = output_rel(StageKind::Depth, &it.stem, OutputKind::Main);
            decode::read_depth(&x.output.join(&rel))
                .map(|(h, w, v)| DepthData { h, w, values: Arc::new(v) })
                .map_err(|e| format!("{rel}: {e}"))
        });
        if let Some(Ok(d)) = &d {
            est += d.values.len() as u64 * 12;
        }
        depths.push(d);
        let want_geo = m.decode && m.pending.has(StageKind::Chm) && x.cfg.chm.geotiff && m.pre_failed.is_none();
        geos.push(want_geo.then(|| {
            GeoReference::read(&x.input_root.join(&it.file.rel)).map(|g| g.map(Arc::new)).map_err(|e| format!("cannot read the georeferencing: {e}"))
        }));
    }
    let permit = Arc::new(budget.acquire(est, abort)?);
    let items = job
        .members
        .iter()
        .zip(encoded)
        .zip(depths)
        .zip(geos)
        .map(|(((m, e), depth), geo)| LoadedItem {
            member: m.clone(),
            image: e.map(|r| r.and_then(|enc| decode::decode(&enc, &limits))),
            depth,
            geo,
        })
        .collect();
    Some(LoadedChunk { items, permit })
}

// ---------------------------------------------------------------------------------------------
// Write

fn write_float(path: &Path, f: FloatFormat, h: usize, w: usize, v: &[f32]) -> Result<()> {
    match f {
        FloatFormat::F16 => write_npy_f16(path, &[h, w], v),
        FloatFormat::F32 => write_npy_f32(path, &[h, w], v),
    }
}

/// Writes one job's files; `Err(Ok(reason))` is an item failure, `Err(Err(e))` a fatal I/O error.
fn write_job(cfg: &Config, output: &Path, stem: &str, job: &WriteJob) -> std::result::Result<Vec<String>, std::result::Result<String, Error>> {
    let classify = |e: Error| match e {
        Error::Io { .. } => Err(e),
        other => Ok(other.to_string()),
    };
    let stage = job.stage;
    let main = output_rel(stage, stem, OutputKind::Main);
    let viz = output_rel(stage, stem, OutputKind::Viz);
    let mut written = Vec::new();
    match &job.payload {
        Payload::Float { h, w, values, geotiff } => {
            write_float(&output.join(&main), cfg.float_format(stage), *h, *w, values).map_err(classify)?;
            written.push(main);
            if let Some((masked, geo)) = geotiff {
                let tif = output_rel(stage, stem, OutputKind::GeoTiff);
                write_geotiff_f32(&output.join(&tif), *w as u32, *h as u32, masked, Some(geo)).map_err(classify)?;
                written.push(tif);
            }
            if cfg.visualize(stage) {
                write_png_rgb8(&output.join(&viz), *w as u32, *h as u32, &colorize(values)).map_err(classify)?;
                written.push(viz);
            }
        }
        Payload::Edges(d) => {
            let e = (|| -> Result<Vec<f32>> {
                let t = Tensor::from_slice(&d.values[..], (1, 1, d.h, d.w), &Device::Cpu)?;
                Ok(sobel_magnitude(&t)?.flatten_all()?.to_vec1::<f32>()?)
            })()
            .map_err(|e| Ok(e.to_string()))?;
            write_float(&output.join(&main), cfg.float_format(stage), d.h, d.w, &e).map_err(classify)?;
            written.push(main);
            if cfg.visualize(stage) {
                write_png_rgb8(&output.join(&viz), d.w as u32, d.h as u32, &colorize(&e)).map_err(classify)?;
                written.push(viz);
            }
        }
        Payload::Classes { h, w, ids, classes } => {
            let model = job.model.as_deref().unwrap_or("");
            let text = [("Software", "edgerun annotate"), ("edgerun:model", model), ("edgerun:classes", classes.metadata.as_str())];
            write_png_gray8(&output.join(&main), *w as u32, *h as u32, ids, &text).map_err(classify)?;
            written.push(main);
            if cfg.visualize(stage) {
                write_png_rgb8(&output.join(&viz), *w as u32, *h as u32, &classes.map.colorize(ids)).map_err(classify)?;
                written.push(viz);
            }
        }
    }
    Ok(written)
}

fn writer_loop(x: &View<'_>, rx: &Mutex<Receiver<WriteJob>>, jtx: mpsc::Sender<JMsg>, shared: &Shared) {
    loop {
        let job = {
            let r = rx.lock().unwrap_or_else(|p| p.into_inner());
            match r.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        if shared.abort.load(Ordering::Relaxed) {
            continue;
        }
        let t = Instant::now();
        let res = write_job(x.cfg, x.output, &x.items[job.item].stem, &job);
        *shared.write_s.lock().unwrap_or_else(|p| p.into_inner()).entry(job.stage).or_default() += t.elapsed().as_secs_f64();
        let rec = match res {
            Ok(outputs) => record(x.items, x.shard, job.item, Status::Ok, job.model.clone(), outputs, None),
            Err(Ok(reason)) => record(x.items, x.shard, job.item, Status::Failed, job.model.clone(), vec![], Some(reason)),
            Err(Err(e)) => {
                shared.fail(e);
                continue;
            }
        };
        if jtx.send(JMsg { item: job.item, stage: job.stage, record: rec }).is_err() {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Journal

struct JournalOut {
    stages: HashMap<StageKind, StageSummary>,
    failed_items: BTreeSet<usize>,
    failures: Vec<Failure>,
    recorded: Option<Vec<(usize, StageKind, Instant, bool)>>,
}

fn journal_loop(
    journals: &mut HashMap<StageKind, Journal>,
    progress: &mut Progress,
    mut remaining: HashMap<usize, (usize, bool)>,
    rx: Receiver<JMsg>,
    shared: &Shared,
    track: bool,
) -> JournalOut {
    let mut out = JournalOut { stages: HashMap::new(), failed_items: BTreeSet::new(), failures: Vec::new(), recorded: track.then(Vec::new) };
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(m) => {
                if let Some(j) = journals.get_mut(&m.stage) {
                    if let Err(e) = j.append(&m.record) {
                        shared.fail(e);
                    }
                }
                if let Some(r) = &mut out.recorded {
                    r.push((m.item, m.stage, Instant::now(), m.record.status == Status::Ok));
                }
                let st = out.stages.entry(m.stage).or_default();
                let failed = m.record.status == Status::Failed;
                if failed {
                    st.failed += 1;
                    if out.failures.len() < MAX_FAILURES_LISTED {
                        out.failures.push(Failure {
                            stage: m.stage.name().into(),
                            input: m.record.input.clone(),
                            reason: m.record.reason.clone().unwrap_or_default(),
                        });
                    }
                } else {
                    st.done += 1;
                    if let Some(model) = &m.record.model {
                        *st.by_model.entry(model.clone()).or_default() += 1;
                    }
                }
                if let Some(r) = remaining.get_mut(&m.item) {
                    r.0 = r.0.saturating_sub(1);
                    r.1 |= failed;
                    if r.0 == 0 {
                        let f = r.1;
                        remaining.remove(&m.item);
                        if f {
                            out.failed_items.insert(m.item);
                        }
                        progress.item_done(f);
                    }
                }
                progress.tick();
            }
            Err(RecvTimeoutError::Timeout) => {
                for j in journals.values_mut() {
                    if let Err(e) = j.sync_if_due() {
                        shared.fail(e);
                    }
                }
                progress.tick();
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    for j in journals.values_mut() {
        if let Err(e) = j.sync() {
            shared.fail(e);
        }
    }
    progress.finish();
    out
}

// ---------------------------------------------------------------------------------------------
// Inference

struct InferCtx<'s> {
    wtx: SyncSender<WriteJob>,
    jtx: mpsc::Sender<JMsg>,
    wait_output_s: f64,
    model_s: HashMap<StageKind, f64>,
    shared: &'s Shared,
}

impl InferCtx<'_> {
    fn write(&mut self, job: WriteJob) {
        match self.wtx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(job)) => {
                let t = Instant::now();
                let _ = self.wtx.send(job);
                self.wait_output_s += t.elapsed().as_secs_f64();
            }
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    fn fail(&mut self, x: &View<'_>, item: usize, stage: StageKind, reason: String) {
        let rec = record(x.items, x.shard, item, Status::Failed, None, vec![], Some(reason));
        let _ = self.jtx.send(JMsg { item, stage, record: rec });
    }
}

fn infer_chunk(x: &View<'_>, chains: &mut [ModelChain], devices: &mut Devices, chunk: LoadedChunk, ctx: &mut InferCtx<'_>) {
    let LoadedChunk { items, permit } = chunk;
    let depth_format = x.cfg.float_format(StageKind::Depth);
    // In-memory depth of this pass, per member, for edges.
    let mut fresh_depth: Vec<Option<std::result::Result<DepthData, String>>> = (0..items.len()).map(|_| None).collect();
    let decoded: Vec<usize> = (0..items.len()).filter(|&i| matches!(items[i].image, Some(Ok(_)))).collect();
    let cfg = x.cfg;
    for chain in chains.iter_mut() {
        let kind = chain.kind();
        let ok: Vec<usize> = decoded.iter().copied().filter(|&i| !items[i].member.left_out.has(kind)).collect();
        let images: Vec<&RgbImage> = ok.iter().filter_map(|&i| items[i].image.as_ref().and_then(|r| r.as_ref().ok())).collect();
        // The whole batch runs this stage if any member needs it (so results never depend on which
        // members an earlier run finished).
        if images.is_empty() || !items.iter().any(|it| it.member.decode && it.member.pending.has(kind)) {
            continue;
        }
        let t = Instant::now();
        let mut warn = |m: String| super::log(&m);
        let keys: Vec<&str> = ok.iter().map(|&i| x.items[items[i].member.item].file.rel.as_str()).collect();
        let results = match chain.predict(&images, &keys, cfg, devices, &mut warn) {
            Ok(r) => r,
            Err(e) => {
                ctx.shared.fail(e);
                return;
            }
        };
        *ctx.model_s.entry(kind).or_default() += t.elapsed().as_secs_f64();
        for (&pos, res) in ok.iter().zip(results) {
            let m = &items[pos].member;
            match res {
                Ok((pred, mi)) => {
                    let model = Some(chain.model_name(mi).to_string());
                    match pred {
                        Prediction::Float { height, width, values } => {
                            let values = if kind == StageKind::Depth { Arc::new(as_stored(values, depth_format)) } else { Arc::new(values) };
                            if kind == StageKind::Depth && m.pending.has(StageKind::Edges) && !m.read_depth {
                                fresh_depth[pos] = Some(Ok(DepthData { h: height, w: width, values: values.clone() }));
                            }
                            if m.pending.has(kind) {
                                let geotiff = match (kind, &items[pos].geo) {
                                    (StageKind::Chm, Some(Err(reason))) => {
                                        ctx.fail(x, m.item, kind, reason.clone());
                                        continue;
                                    }
                                    (StageKind::Chm, Some(Ok(Some(g)))) => {
                                        items[pos].image.as_ref().and_then(|r| r.as_ref().ok()).map(|img| (nodata_masked(&values, img, g), g.clone()))
                                    }
                                    _ => None,
                                };
                                ctx.write(WriteJob { item: m.item, stage: kind, model, payload: Payload::Float { h: height, w: width, values, geotiff }, _permit: permit.clone() });
                            }
                        }
                        Prediction::Classes { height, width, ids, classes } => {
                            if m.pending.has(kind) {
                                ctx.write(WriteJob { item: m.item, stage: kind, model, payload: Payload::Classes { h: height, w: width, ids, classes }, _permit: permit.clone() });
                            }
                        }
                    }
                }
                Err(reason) => {
                    if kind == StageKind::Depth && m.pending.has(StageKind::Edges) && !m.read_depth {
                        fresh_depth[pos] = Some(Err(format!("no depth map: {reason}")));
                    }
                    if m.pending.has(kind) {
                        ctx.fail(x, m.item, kind, reason);
                    }
                }
            }
        }
    }
    // Members that could not be read, and edges.
    for (pos, it) in items.into_iter().enumerate() {
        let m = &it.member;
        let read_err = match (&m.pre_failed, &it.image) {
            (Some(r), _) => Some(r.clone()),
            (None, Some(Err(r))) => Some(r.clone()),
            _ => None,
        };
        if let Some(r) = &read_err {
            for k in m.pending.iter().filter(|k| k.has_model()) {
                ctx.fail(x, m.item, k, r.clone());
            }
        }
        if m.pending.has(StageKind::Edges) {
            let depth = if m.read_depth { it.depth.clone() } else { fresh_depth[pos].take() };
            match (depth, &m.pre_failed, read_err) {
                (_, Some(r), _) => ctx.fail(x, m.item, StageKind::Edges, r.clone()),
                (Some(Ok(d)), _, _) => ctx.write(WriteJob { item: m.item, stage: StageKind::Edges, model: None, payload: Payload::Edges(d), _permit: permit.clone() }),
                (Some(Err(r)), _, _) => ctx.fail(x, m.item, StageKind::Edges, r),
                (None, _, Some(r)) => ctx.fail(x, m.item, StageKind::Edges, r),
                (None, _, None) => ctx.fail(x, m.item, StageKind::Edges, "no depth map was produced".into()),
            }
        }
        if ctx.shared.abort.load(Ordering::Relaxed) {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------

/// Runs the pipeline over `x.jobs`.
pub(crate) fn execute(x: Exec<'_>) -> Result<ExecStats> {
    let start = Instant::now();
    let Exec { cfg, input_root, output, items, jobs, chains, devices, journals, shard, mut progress, track } = x;
    let view = View { cfg, input_root, output, items, jobs: &jobs, shard: &shard };
    let shared = Shared { abort: AtomicBool::new(false), fatal: Mutex::new(None), write_s: Mutex::new(HashMap::new()), decode_s: Mutex::new(0.0) };
    let budget = Arc::new(Budget { limit: cfg.memory_mb.saturating_mul(1 << 20), used: Mutex::new(0), cv: Condvar::new() });
    let mut remaining: HashMap<usize, (usize, bool)> = HashMap::new();
    for j in &jobs {
        for m in &j.members {
            if !m.pending.is_empty() {
                remaining.insert(m.item, (m.pending.len(), false));
            }
        }
    }
    let n_decoders = match cfg.decode_threads {
        0 => std::thread::available_parallelism().map(|n| n.get() / 2).unwrap_or(1).clamp(1, 8),
        n => n,
    }
    .min(jobs.len().max(1));
    let (ctx_tx, ctx_rx) = mpsc::sync_channel::<LoadedChunk>(cfg.prefetch);
    let (wtx, wrx) = mpsc::sync_channel::<WriteJob>(cfg.write_threads * 4);
    let (jtx, jrx) = mpsc::channel::<JMsg>();
    let wrx = Mutex::new(wrx);
    let next = AtomicUsize::new(0);
    let (jout, wait_input_s, wait_output_s, model_s) = std::thread::scope(|s| {
        let view = &view;
        let shared = &shared;
        let progress = &mut progress;
        let journals = &mut *journals;
        let journal = s.spawn(move || journal_loop(journals, progress, remaining, jrx, shared, track));
        for _ in 0..cfg.write_threads {
            let jtx = jtx.clone();
            let wrx = &wrx;
            s.spawn(move || writer_loop(view, wrx, jtx, shared));
        }
        for _ in 0..n_decoders {
            let tx = ctx_tx.clone();
            let (next, budget) = (&next, &budget);
            s.spawn(move || loop {
                if shared.abort.load(Ordering::Relaxed) {
                    return;
                }
                let j = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = view.jobs.get(j) else { return };
                let t = Instant::now();
                let loaded = decode_chunk(view, job, budget, &shared.abort);
                *shared.decode_s.lock().unwrap_or_else(|p| p.into_inner()) += t.elapsed().as_secs_f64();
                match loaded {
                    Some(c) => {
                        if tx.send(c).is_err() {
                            return;
                        }
                    }
                    None => return,
                }
            });
        }
        drop(ctx_tx);
        // Inference runs on this thread.
        let mut ctx = InferCtx { wtx, jtx, wait_output_s: 0.0, model_s: HashMap::new(), shared };
        let mut wait_in = 0.0;
        loop {
            let t = Instant::now();
            let Ok(chunk) = ctx_rx.recv() else { break };
            wait_in += t.elapsed().as_secs_f64();
            if shared.abort.load(Ordering::Relaxed) {
                break;
            }
            infer_chunk(view, chains, devices, chunk, &mut ctx);
        }
        drop(ctx_rx);
        let InferCtx { wtx, jtx, wait_output_s, model_s, .. } = ctx;
        // Closing the queues lets the writers, then the journal thread, finish.
        drop(wtx);
        drop(jtx);
        let jout = journal.join().unwrap_or_else(|_| JournalOut { stages: HashMap::new(), failed_items: BTreeSet::new(), failures: vec![], recorded: None });
        (jout, wait_in, wait_output_s, model_s)
    });
    if let Some(e) = shared.fatal.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let mut stats = ExecStats {
        stages: jout.stages,
        failed_items: jout.failed_items,
        pipeline_s: start.elapsed().as_secs_f64(),
        wait_input_s,
        wait_output_s,
        decode_s: shared.decode_s.into_inner().unwrap_or_else(|p| p.into_inner()),
        failures: jout.failures,
        recorded: jout.recorded.unwrap_or_default(),
        ..Default::default()
    };
    for (k, v) in shared.write_s.into_inner().unwrap_or_else(|p| p.into_inner()) {
        stats.stages.entry(k).or_default().write_s = v;
    }
    for (k, v) in model_s {
        stats.model_busy_s += v;
        stats.stages.entry(k).or_default().model_s = v;
    }
    Ok(stats)
}
