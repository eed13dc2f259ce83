//! On-device fine-tuning: optimiser, schedule, EMA, losses, data, checkpoints and the loop, built on
//! the inference model structs (trainable weights are `Var`s inside them).
pub mod adamw;
pub mod config;
pub mod data;
pub mod ema;
pub mod features;
pub mod finetune;
pub mod grads;
pub mod losses;
pub mod mix;
pub(crate) mod objective;
pub mod outputs;
pub mod recompute;
pub mod rng;
pub mod sampling;
pub mod schedule;
pub mod select;
