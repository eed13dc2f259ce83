//! `edgerun lgatr`: packed events of different lengths give the same outputs as each event alone.
mod common;

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use common::*;
use edgerun::models::NamedTensors;
use edgerun::tensor_io::write_tensors;

#[test]
fn packed_events_match_single_event_forwards() {
    let dir = fixture("lgatr_tiny");
    let inputs = tensors(&dir, "input.safetensors");
    let (mv, s) = (&inputs["multivectors"], &inputs["scalars"]);
    // Two events: 16 items of batch row 0 and the first 9 items of row 1.
    let lens = [16usize, 9];
    let ev_mv = [mv.get(0).unwrap(), mv.get(1).unwrap().narrow(0, 0, 9).unwrap()];
    let ev_s = [s.get(0).unwrap(), s.get(1).unwrap().narrow(0, 0, 9).unwrap()];
    let mut packed: NamedTensors = BTreeMap::new();
    packed.insert("multivectors".into(), Tensor::cat(&ev_mv, 0).unwrap());
    packed.insert("scalars".into(), Tensor::cat(&ev_s, 0).unwrap());
    packed.insert("lengths".into(), Tensor::new(&[16i64, 9], &candle_core::Device::Cpu).unwrap());
    let tmp = tempfile::tempdir().unwrap();
    let (inp, out) = (tmp.path().join("events.safetensors"), tmp.path().join("out.safetensors"));
    write_tensors(&inp, &packed).unwrap();
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_edgerun"))
        .args(["lgatr", "--model", dir.to_str().unwrap(), "--input", inp.to_str().unwrap(), "--output", out.to_str().unwrap(), "--device", &device_arg()])
        .status()
        .unwrap();
    assert!(st.success());
    let got = tensors(tmp.path(), "out.safetensors");
    // Exactly the packed items come back: no padding rows, nothing dropped.
    let total: usize = lens.iter().sum();
    assert_eq!(got["outputs_mv"].dims(), &[total, 1, 16]);
    assert_eq!(got["outputs_s"].dims()[0], total);
    let model = load_model(&dir, DType::F32);
    let mut offset = 0;
    for (k, &n) in lens.iter().enumerate() {
        let mut one = NamedTensors::new();
        one.insert("multivectors".into(), ev_mv[k].unsqueeze(0).unwrap());
        one.insert("scalars".into(), ev_s[k].unsqueeze(0).unwrap());
        let want = model.forward_named(&one).unwrap();
        for name in ["outputs_mv", "outputs_s"] {
            let g = got[name].narrow(0, offset, n).unwrap();
            assert_close(&format!("event {k} {name}"), &g, &want[name].squeeze(0).unwrap(), 1e-5);
        }
        offset += n;
    }
}
