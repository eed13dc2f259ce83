//! Fixed pseudo-random test inputs: a test whose error depends on the draw must not pass or fail
//! by chance.
use candle_core::{Device, Shape, Tensor};

/// Unit-variance values (uniform on ±√3) from a xorshift sequence, different per `seed`.
pub(crate) fn spread(shape: impl Into<Shape>, seed: u64, dev: &Device) -> Tensor {
    let shape = shape.into();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let values: Vec<f32> = (0..shape.elem_count())
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 3f32.sqrt()
        })
        .collect();
    Tensor::from_vec(values, shape, dev).expect("the values fill the shape")
}
