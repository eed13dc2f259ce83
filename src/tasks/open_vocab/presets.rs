//! SegEarth-OV-3's per-dataset settings (its `configs/cfg_*.py` and `cls_*.txt`, commit 87e5cc1) as
//! named presets.
use super::{Params, Slide};

/// A named dataset setting: its class file and parameters.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    /// The name `--preset` takes.
    pub name: &'static str,
    /// The class file's text.
    pub classes: &'static str,
    /// `confidence_threshold`.
    pub conf: f32,
    /// `prob_thd`.
    pub prob_thd: f32,
    /// `bg_idx`.
    pub bg_idx: u8,
    /// `slide_crop` and `slide_stride` (0: off).
    pub slide: (usize, usize),
}

impl Preset {
    /// Its parameters.
    pub fn params(&self) -> Params {
        let slide = (self.slide.0 > 0).then_some(Slide { crop: self.slide.0, stride: self.slide.1 });
        Params { conf: self.conf, prob_thd: self.prob_thd, bg_idx: self.bg_idx, slide }
    }
}

/// Every preset.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "openearthmap",
        classes: "background\nbareland,barren\ngrass\npavement\nroad\ntree,forest\nwater,river\ncropland\nbuilding,roof,house",
        conf: 0.1,
        prob_thd: 0.1,
        bg_idx: 0,
        slide: (512, 512),
    },
    Preset { name: "loveda", classes: "background\nbuilding,house\nroad\nwater\nbarren,bareland,soil\nforest,tree\nagricultural", conf: 0.5, prob_thd: 0.5, bg_idx: 0, slide: (0, 0) },
    Preset {
        name: "isaid",
        classes: "background\nship\nstore tank\nbaseball diamond\ntennis court\nbasketball court\nground track field\nbridge\nlarge vehicle\nsmall vehicle\nhelicopter\nswimming pool\nroundabout\nsoccer ball field\nplane\nharbor",
        conf: 0.4,
        prob_thd: 0.5,
        bg_idx: 0,
        slide: (0, 0),
    },
    Preset { name: "potsdam", classes: "road\nbuilding\ngrass\ntree\ncar\nclutter", conf: 0.2, prob_thd: 0.1, bg_idx: 5, slide: (0, 0) },
    Preset { name: "vaihingen", classes: "road\nbuilding\ngrass\ntree\ncar\nclutter", conf: 0.4, prob_thd: 0.1, bg_idx: 5, slide: (0, 0) },
    Preset { name: "uavid", classes: "background\nbuilding\nroad\ncar\ntree\nvegetation\nhuman", conf: 0.3, prob_thd: 0.3, bg_idx: 0, slide: (0, 0) },
    Preset { name: "udd5", classes: "vegetation\nbuilding\nroad\nvehicle\nbackground", conf: 0.5, prob_thd: 0.1, bg_idx: 4, slide: (0, 0) },
    Preset { name: "vdd", classes: "background\nfacade\nroad\nvegetation\nvehicle\nroof\nwater", conf: 0.5, prob_thd: 0.3, bg_idx: 0, slide: (0, 0) },
];

/// The preset called `name` (case-insensitive).
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

/// The presets' names, for messages.
pub fn preset_names() -> String {
    PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
}
