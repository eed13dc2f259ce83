//! Image decoding with size limits, and atomic writers for the output formats (NPY, PNG).
pub(crate) mod class_map;
pub mod colormap;
pub(crate) mod cv_resize;
pub mod decode;
pub mod npy;
pub(crate) mod png_out;
pub mod resample;

pub use decode::{load_rgb, rgb_to_tensor, ImageLimits};
pub use npy::write_npy_f16;
pub use png_out::{write_png_gray8, write_png_rgb8};

/// File extensions treated as images when a directory is walked.
pub(crate) const IMAGE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg", "tif", "tiff"];

