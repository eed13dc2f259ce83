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
/// Empty events cost no forward pass (their outputs are empty tensors of the right shape), so the
/// time is linear in the number of events plus the work on the non-empty ones.
pub fn forward_events(model: &dyn Model, events: &[NamedTensors], max_batch: usize) -> Result<Vec<NamedTensors>> {
    check_event_count(events.len())?;
    let names = model.input_names();
    let lens = events.iter().enumerate().map(|(i, e)| event_len(e, &names, i)).collect::<Result<Vec<_>>>()?;
    let mut order: Vec<usize> = (0..events.len()).filter(|&i| lens[i] > 0).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let per = if max_batch == 0 { order.len().max(1) } else { max_batch };
    let mut results: Vec<Option<NamedTensors>> = vec![None; events.len()];
    let mut empty_template: Option<NamedTensors> = None;
    for group in order.chunks(per) {
        let outs = run_group(model, events, &names, &lens, group)?;
        if empty_template.is_none() {
            empty_template = outs.first().map(|o| o.iter().map(|(k, t)| Ok((k.clone(), t.narrow(0, 0, 0)?))).collect::<Result<_>>()).transpose()?;
        }
        for (&i, o) in group.iter().zip(outs) {
            results[i] = Some(o);
        }
    }
    let empties: Vec<usize> = (0..events.len()).filter(|&i| lens[i] == 0).collect();
    if let Some(&first) = empties.first() {
        let template = match empty_template {
            Some(t) => t,
            // Only empty events: one forward pass on a single masked item gives the output shapes.
            None => run_group(model, events, &names, &lens, &[first])?.into_iter().next().ok_or_else(|| Error::Input("internal: no output for an empty event".into()))?,
        };
        for i in empties {
            results[i] = Some(template.clone());
        }
    }
    results.into_iter().map(|r| r.ok_or_else(|| Error::Input("internal: event not processed".into()))).collect()
}

/// One padded, masked forward pass over the events `group` (at least one slot: a group of empty
/// events runs on one masked dummy item); the outputs of each event, unpadded.
fn run_group(model: &dyn Model, events: &[NamedTensors], names: &[&str], lens: &[usize], group: &[usize]) -> Result<Vec<NamedTensors>> {
    let n_max = group.iter().map(|&i| lens[i]).max().unwrap_or(0).max(1);
    let mut batch = NamedTensors::new();
    for name in names {
        let mut rows = Vec::with_capacity(group.len());
        for &i in group {
            let Some(t) = events[i].get(*name) else { continue };
            let pad = n_max - lens[i];
            rows.push(if pad > 0 { t.pad_with_zeros(0, 0, pad)? } else { t.clone() });
        }
        if !rows.is_empty() {
            batch.insert(
                (*name).to_string(),
                Tensor::stack(&rows, 0).map_err(|e| Error::Input(format!("events disagree on the shape of `{name}`: {e}")))?,
            );
        }
    }
    let device = batch.values().next().map(|t| t.device().clone()).unwrap_or(candle_core::Device::Cpu);
    let mut mask = vec![0u8; group.len() * n_max];
    for (row, &i) in group.iter().enumerate() {
        mask[row * n_max..row * n_max + lens[i]].fill(1);
    }
    batch.insert("padding_mask".into(), Tensor::from_vec(mask, (group.len(), n_max), &device)?);
    let out = crate::device::on_pool_worker(&device, || model.forward_named(&batch))?;
    let mut per_event = Vec::with_capacity(group.len());
    for (row, &i) in group.iter().enumerate() {
        let mut ev = NamedTensors::new();
        for (k, t) in &out {
            if t.rank() < 2 || t.dim(0)? != group.len() || t.dim(1)? != n_max {
                return Err(Error::Input(format!("output `{k}` {:?} is not per item", t.dims())));
            }
            ev.insert(k.clone(), t.get(row)?.narrow(0, 0, lens[i])?.contiguous()?);
        }
        per_event.push(ev);
    }
    Ok(per_event)
}

/// Most events in one packed file or one call.
pub(crate) const MAX_EVENTS: usize = 1 << 20;

fn check_event_count(e: usize) -> Result<()> {
    if e > MAX_EVENTS {
        return Err(Error::Input(format!("{e} events, more than the limit {MAX_EVENTS}")));
    }
    Ok(())
}

/// The event lengths of a packed batch: `lengths` must be a 1-D integer tensor of non-negative
/// values (floats are refused: a float length is either not a count or not exact), at most
/// [`MAX_EVENTS`] of them, whose sum (checked) is returned with them.
fn lengths_of(packed: &NamedTensors) -> Result<(Vec<usize>, usize)> {
    let l = packed.get("lengths").ok_or_else(|| Error::Input("packed events need a `lengths` tensor [E]".into()))?;
    if l.dtype().is_float() {
        return Err(Error::Input(format!("`lengths` must be an integer tensor, got {:?}", l.dtype())));
    }
    if l.rank() != 1 {
        return Err(Error::Input(format!("`lengths` must be 1-D [E], got shape {:?}", l.dims())));
    }
    check_event_count(l.dim(0)?)?;
    let raw = l.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    let lens = raw
        .into_iter()
        .enumerate()
        .map(|(i, v)| usize::try_from(v).map_err(|_| Error::Input(format!("`lengths[{i}]` = {v} is negative"))))
        .collect::<Result<Vec<_>>>()?;
    let total = lens.iter().try_fold(0usize, |s, &n| s.checked_add(n)).ok_or_else(|| Error::Input("the sum of `lengths` overflows".into()))?;
    Ok((lens, total))
}

/// Splits packed events `{name: [ΣN, ...], lengths: [E]}` (items of all events concatenated
/// along dim 0) into per-event maps.
pub fn unpack_events(packed: &NamedTensors) -> Result<Vec<NamedTensors>> {
    let (lens, total) = lengths_of(packed)?;
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
        // Empty events add no rows; leaving them out keeps the concatenation linear in the data.
        let non_empty: Vec<Tensor> = parts.iter().filter(|t| t.dims().first().is_some_and(|&n| n > 0)).cloned().collect();
        out.insert(name.clone(), Tensor::cat(if non_empty.is_empty() { &parts[..1] } else { &non_empty }, 0)?);
    }
    let device = first.values().next().map(|t| t.device().clone()).unwrap_or(candle_core::Device::Cpu);
    let e = lens.len();
    out.insert("lengths".into(), Tensor::from_vec(lens, e, &device)?);
    Ok(out)
}
