//! Image-level tasks: preprocessing, batched forward passes and postprocessing around the raw models.
pub mod batch;
pub mod chm;
pub mod depth;
