//! L-GATr (`lgatr` 2.0.0): the Lorentz-equivariant geometric-algebra transformer `LGATr` and its
//! vector/scalar variant `LGATrSlim`, loading lgatr state dicts as they are.
//!
//! * [`algebra`]: Cl(1,3) basis, geometric-product and equivariant-linear tables generated from
//!   first principles; Lorentz matrices and their 16×16 outermorphism.
//! * [`primitives`], [`bilinear`]: lgatr's functional primitives and the geometric product.
//! * [`equi_linear`]: `EquiLinear` folded into one dense matrix at load time.
//! * [`norm`], [`attention`], [`mlp`], [`block`], [`net`]: the LGATr layers on a fused per-item
//!   layout `[mv (C, 16) | s (S)]`; [`slim`]: `LGATrSlim`.
//! * [`events`]: variable-length event batches (padding + mask).
//!
//! `config.json` = `{"model_type": "lgatr" | "lgatr_slim", …constructor kwargs…}`, weights =
//! the state dict (`model.safetensors`); see [`load`].
pub mod algebra;
pub mod attention;
pub mod bilinear;
pub mod block;
pub mod config;
pub mod equi_linear;
pub mod events;
mod family;
mod kernels;
pub mod mlp;
pub mod net;
pub mod norm;
pub mod primitives;
pub mod slim;

use candle_nn::VarBuilder;

pub use config::{AttentionConfig, LgatrConfig, MlpConfig, Nonlinearity, PrimitivesConfig, SlimConfig};
pub use events::{forward_events, pack_events, unpack_events};
pub(crate) use family::LgatrFamily;
pub use net::Lgatr;
pub(crate) use slim::LgatrSlim;

use crate::error::{Error, Result};
use crate::models::Model;
pub use equi_linear::MapStorage;

/// A parsed L-GATr config: the full model or the vector/scalar variant.
#[derive(Debug, Clone)]
pub enum Config {
    /// `LGATr`.
    Full(LgatrConfig),
    /// `LGATrSlim`.
    Slim(SlimConfig),
}

impl Config {
    /// Parses and checks `config.json` (dispatching on `model_type`).
    pub fn from_json(config: &serde_json::Value) -> Result<Self> {
        match config.get("model_type").and_then(|v| v.as_str()) {
            Some("lgatr") => Ok(Config::Full(LgatrConfig::from_json(config)?)),
            Some("lgatr_slim") => Ok(Config::Slim(SlimConfig::from_json(config)?)),
            Some(other) => Err(Error::Config(format!("model_type `{other}` is not an lgatr model (lgatr | lgatr_slim)"))),
            None => Err(Error::Config("config.json lacks a string `model_type` (lgatr | lgatr_slim)".into())),
        }
    }
}

/// Builds an `LGATr` or `LGATrSlim` from its state dict (`vb`, keys as lgatr writes them) and its
/// config; `maps`: how `LGATr` holds its folded maps (see [`LgatrConfig::hold_maps`]).
pub fn load(vb: VarBuilder, config: &Config, maps: MapStorage) -> Result<Box<dyn Model>> {
    match config {
        Config::Full(c) => Ok(Box::new(Lgatr::load(vb, LgatrConfig { hold_maps: maps, ..c.clone() })?)),
        Config::Slim(c) => Ok(Box::new(LgatrSlim::load(vb, c.clone())?)),
    }
}
