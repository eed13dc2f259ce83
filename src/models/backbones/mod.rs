//! The ViT backbones and DPT neck blocks that several families share: DINOv2 (Depth Anything V1/V2,
//! DA3), DINOv3 (CHMv2) and the DPT reassemble and fusion blocks.
pub(crate) mod dinov2;
pub mod dinov3;
pub mod dpt;
