//! The registry: every family has every part, and each part works on a fixture checkpoint of
//! that family — it is recognised, its config parses, it loads, its recipe parses, and it has an
//! image processor, a growing activation estimate and depth outputs where its tasks need them, and
//! a trainee whose backbone layout orders its blocks where it fine-tunes.
mod common;

use std::collections::{BTreeMap, BTreeSet};

use candle_core::{DType, Device};
use common::fixture;
use edgerun::models::{Checkpoint, FAMILIES};
use edgerun::quantize::Recipe;
use edgerun::tasks::Task;
use edgerun::train::select::{select, TrainSpec};
use edgerun::weights::{Trainable, Vb};

/// Every fixture checkpoint, by family name.
fn fixtures_by_family() -> BTreeMap<&'static str, Vec<Checkpoint>> {
    let mut by = BTreeMap::<&'static str, Vec<Checkpoint>>::new();
    for e in std::fs::read_dir(fixture("")).unwrap() {
        let dir = e.unwrap().path();
        if dir.join("config.json").exists() && dir.join("model.safetensors").exists() {
            let ckpt = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            by.entry(ckpt.family().name()).or_default().push(ckpt);
        }
    }
    by
}

#[test]
fn every_family_has_every_part_and_each_works() {
    let fixtures = fixtures_by_family();
    let mut seen = BTreeSet::new();
    for family in FAMILIES {
        let name = family.name();
        assert!(!family.architectures().is_empty(), "{name}: no architecture names");
        for arch in family.architectures() {
            assert!(seen.insert(*arch), "{name}: architecture `{arch}` is claimed twice");
            let recipe = Recipe::builtin(arch).unwrap_or_else(|e| panic!("{name}: the recipe for `{arch}` does not parse: {e}"));
            assert_eq!(recipe.map(|r| r.arch), Some(arch.to_string()), "{name}: no recipe for `{arch}`");
        }
        assert!(!family.tasks().is_empty(), "{name}: serves no task");
        let ckpts = fixtures.get(name).unwrap_or_else(|| panic!("{name}: no fixture checkpoint under tests/fixtures"));
        for ckpt in ckpts {
            let at = format!("{name} ({})", ckpt.path().display());
            ckpt.load(&Device::Cpu, DType::F32).unwrap_or_else(|e| panic!("{at}: does not load: {e}"));
            let images = family.tasks().iter().any(|t| *t != Task::Events);
            let processor = ckpt.processor().unwrap_or_else(|e| panic!("{at}: processor: {e}"));
            let footprint = ckpt.footprint(DType::F32);
            assert_eq!(processor.is_some(), images, "{at}: an image processor exactly where its tasks take images");
            assert_eq!(footprint.is_some(), images, "{at}: an activation estimate exactly where its tasks take images");
            if let (Some(p), Some(f)) = (processor, footprint) {
                assert!(p.working_size() > 0 && p.normalization().is_ok(), "{at}: processor");
                let small = f.per_item((112, 112), (100, 100));
                let big = f.per_item((224, 224), (100, 100));
                assert!(small > 0 && big > 3 * small, "{at}: the estimate must grow with the input: {small} → {big}");
            }
            assert_eq!(ckpt.depth_outputs().is_some(), family.tasks().contains(&Task::Depth), "{at}: depth outputs exactly for depth models");
            let vb = Vb::new(ckpt.store().clone(), DType::F32, Device::Cpu);
            match family.training() {
                Some(layout) => {
                    let names: Vec<String> = ckpt.store().entries().keys().cloned().collect();
                    let all = select(&layout, TrainSpec::All, &names).unwrap();
                    let last = select(&layout, TrainSpec::Last(1), &names).unwrap_or_else(|e| panic!("{at}: last:1: {e}"));
                    let head = select(&layout, TrainSpec::Head, &names).unwrap();
                    assert!(head.len() < last.len() && last.len() < all.len(), "{at}: head ⊂ last:1 ⊂ all");
                    let chosen = last.clone();
                    let vb = vb.with_trainable(Trainable::new(move |n| chosen.contains(n)));
                    let trainee = ckpt.trainee(&vb).unwrap_or_else(|e| panic!("{at}: trainee: {e}"));
                    assert!(trainee.input_multiple() >= 1);
                }
                None => assert!(ckpt.trainee(&vb).is_err(), "{at}: trains without a training layout"),
            }
        }
    }
}
