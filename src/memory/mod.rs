//! How much memory a device can spare ([`available`]: `MemAvailable`, the limits of the cgroups in
//! [`cgroup`], the GPU driver), for the batch planner in [`crate::runner`]. Per-item activation
//! estimates live with the model families (`models::footprint`).
pub mod available;
pub mod cgroup;
pub(crate) mod oom;
pub(crate) mod procfs;

pub use available::{cpu_available, cpu_available_at, Available};
pub(crate) use available::available;
