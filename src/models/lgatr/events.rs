//! Variable-length event batches: pad to the longest event, mask the padding keys, unpad.
//!
//! Each event is a [`NamedTensors`] holding the model's inputs without the batch dim
//! (LGATr: `multivectors [N, C, 16]`, `scalars [N, S]`; slim: `vectors [N, C, 4]`, `scalars`).
//! Events of a batch are processed together but never see each other: they occupy different
//! batch rows, and a key-padding mask hides the zero padding from the real items, so every
//! event's outputs equal what it gets alone.
use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::models::{Model, NamedTensors};

fn event_len(ev: &NamedTensors, names: &[&str], i: usize) -> Result<usize> {
    let mut n = None;
    for name in names {
        let t = ev.get(*name).ok_or_else(|| Error::Input(format!("event {i}: missing input `{name}`")))?;
        let d = t.dims().first().copied().ok_or_else(|| Error::Input(format!("event {i}: `{name}` is a scalar")))?;
        match n {
            None => n = Some(d),
            Some(m) if m != d => {
                return Err(Error::Input(format!("event {i}: `{name}` has {d} items, other inputs {m}")))
            }
            _ => {}
        }
    }
    if let Some(k) = ev.keys().find(|k| !names.contains(&k.as_str())) {
        return Err(Error::Input(format!("event {i}: unexpected input `{k}` (expected {})", names.join(", "))));
    }
    n.ok_or_else(|| Error::Input(format!("event {i}: no inputs")))
}

/// Runs `events` through `model` in batches of at most `max_batch` events (`0` = all at once),
/// grouping events of similar length, padding with zeros to the longest event of each batch
/// and passing a `padding_mask`. Returns one output map per event, in input order, with the
/// model's output names and the batch dim removed (`outputs_mv [N, C, 16]`, `outputs_s [N, S]`, …).
pub fn forward_events(model: &dyn Model, events: &[NamedTensors], max_batch: usize) -> Result<Vec<NamedTensors>> {
    let names = model.input_names();
    let lens = events.iter().enumerate().map(|(i, e)| event_len(e, &names, i)).collect::<Result<Vec<_>>>()?;
    let mut order: Vec<usize> = (0..events.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let per = if max_batch == 0 { events.len().max(1) } else { max_batch };
    let mut results: Vec<Option<NamedTensors>> = vec![None; events.len()];
    for group in order.chunks(per) {
        // (at least one slot: a group of empty events runs on one masked dummy item)
        let n_max = group.iter().map(|&i| lens[i]).max().unwrap_or(0).max(1);
        let mut batch = NamedTensors::new();
        for name in &names {
            let mut rows = Vec::with_capacity(group.len());
            for &i in group {
                let Some(t) = events[i].get(*name) else { continue };
                let pad = n_max - lens[i];
                rows.push(if pad > 0 { t.pad_with_zeros(0, 0, pad)? } else { t.clone() });
            }
            if !rows.is_empty() {
                batch.insert(
                    (*name).to_string(),
                    Tensor::stack(&rows, 0)
                        .map_err(|e| Error::Input(format!("events disagree on the shape of `{name}`: {e}")))?,
                );
            }
        }
        let device = batch.values().next().map(|t| t.device().clone()).unwrap_or(candle_core::Device::Cpu);
        let mut mask = vec![0u8; group.len() * n_max];
        for (row, &i) in group.iter().enumerate() {
            mask[row * n_max..row * n_max + lens[i]].fill(1);
        }
        batch.insert("padding_mask".into(), Tensor::from_vec(mask, (group.len(), n_max), &device)?);
        let out = model.forward_named(&batch)?;
        for (row, &i) in group.iter().enumerate() {
            let mut ev = NamedTensors::new();
            for (k, t) in &out {
                if t.rank() < 2 || t.dim(0)? != group.len() || t.dim(1)? != n_max {
                    return Err(Error::Input(format!("output `{k}` {:?} is not per item", t.dims())));
                }
                ev.insert(k.clone(), t.get(row)?.narrow(0, 0, lens[i])?.contiguous()?);
            }
            results[i] = Some(ev);
        }
    }
    results.into_iter().map(|r| r.ok_or_else(|| Error::Input("internal: event not processed".into()))).collect()
}

fn lengths_of(packed: &NamedTensors) -> Result<Vec<usize>> {
    let l = packed.get("lengths").ok_or_else(|| Error::Input("packed events need a `lengths` tensor [E]".into()))?;
    let l = l.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    l.into_iter().map(|v| usize::try_from(v).map_err(|_| Error::Input(format!("negative event length {v}")))).collect()
}

/// Splits packed events `{name: [ΣN, ...], lengths: [E]}` (items of all events concatenated
/// along dim 0) into per-event maps.
pub fn unpack_events(packed: &NamedTensors) -> Result<Vec<NamedTensors>> {
    let lens = lengths_of(packed)?;
    let total: usize = lens.iter().sum();
    let mut events = vec![NamedTensors::new(); lens.len()];
    for (name, t) in packed {
        if name == "lengths" {
            continue;
        }
        if t.dims().first() != Some(&total) {
            return Err(Error::Input(format!("packed `{name}` {:?} does not have Σ lengths = {total} rows", t.dims())));
        }
        let mut start = 0;
        for (ev, &n) in events.iter_mut().zip(&lens) {
            ev.insert(name.clone(), t.narrow(0, start, n)?);
            start += n;
        }
    }
    Ok(events)
}

/// Concatenates per-event maps along dim 0 and adds `lengths [E]` (i64): the inverse of
/// [`unpack_events`].
pub fn pack_events(events: &[NamedTensors]) -> Result<NamedTensors> {
    let mut out = NamedTensors::new();
    let Some(first) = events.first() else { return Ok(out) };
    let mut lens = Vec::with_capacity(events.len());
    for ev in events {
        let n = ev.values().next().map(|t| t.dim(0)).transpose()?.unwrap_or(0);
        lens.push(n as i64);
    }
    for name in first.keys() {
        let parts = events
            .iter()
            .enumerate()
            .map(|(i, e)| e.get(name).cloned().ok_or_else(|| Error::Input(format!("event {i} lacks `{name}`"))))
            .collect::<Result<Vec<_>>>()?;
        out.insert(name.clone(), Tensor::cat(&parts, 0)?);
    }
    let device = first.values().next().map(|t| t.device().clone()).unwrap_or(candle_core::Device::Cpu);
    let e = lens.len();
    out.insert("lengths".into(), Tensor::from_vec(lens, e, &device)?);
    Ok(out)
}
