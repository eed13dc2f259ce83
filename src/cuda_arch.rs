//! Candle's fast quantized CUDA matmuls (MMQ / MMVQ) are compiled to machine code for the one GPU
//! architecture of the build (`CUDA_COMPUTE_CAP`); on a GPU of another architecture their launches
//! fail unchecked and leave garbage (seen: Q8_0 models built for 8.7 on an H200, 9.0). There the
//! quantized matmuls take Candle's dequantizing kernels instead, which load from PTX on any newer GPU.
use candle_core::Device;

/// The compute capability the kernels were built for (`87`, `90a`), when the build knew it.
pub const BUILT_FOR: Option<&str> = option_env!("EDGERUN_CUDA_COMPUTE_CAP");

/// Whether machine code built for `built` (`87`, `90a`) runs on a GPU of capability `major.minor`:
/// same major version, minor at least the built one (an `a` suffix runs on that exact GPU only).
pub(crate) fn machine_code_runs(built: &str, major: i32, minor: i32) -> bool {
    let exact = built.ends_with('a');
    let digits: String = built.chars().take_while(|c| c.is_ascii_digit()).collect();
    let Ok(cap) = digits.parse::<i32>() else { return false };
    let (b_major, b_minor) = (cap / 10, cap % 10);
    b_major == major && if exact { b_minor == minor } else { b_minor <= minor }
}

/// The compute capability of a CUDA device (`None` for other devices).
pub fn capability(device: &Device) -> Option<(i32, i32)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return cuda.cuda_stream().context().compute_capability().ok();
    }
    let _ = device;
    None
}

/// Whether Candle's machine-code kernels run on `device` (a CUDA device whose capability the build matches).
pub fn machine_code_runs_on(device: &Device) -> bool {
    match (BUILT_FOR, capability(device)) {
        (Some(built), Some((major, minor))) => machine_code_runs(built, major, minor),
        _ => false,
    }
}

/// Makes Candle's quantized matmuls avoid its machine-code kernels when `device` cannot run them.
pub(crate) fn adapt_quantized_matmuls(device: &Device) {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        candle_core::quantized::cuda::set_force_dmmv(!machine_code_runs_on(device));
    }
    let _ = device;
}

#[cfg(test)]
mod tests {
    use super::machine_code_runs;

    #[test]
    fn machine_code_compatibility() {
        assert!(machine_code_runs("87", 8, 7));
        assert!(machine_code_runs("80", 8, 9));
        assert!(!machine_code_runs("87", 9, 0));
        assert!(!machine_code_runs("87", 8, 6));
        assert!(machine_code_runs("90a", 9, 0));
        assert!(!machine_code_runs("90a", 9, 1));
        assert!(!machine_code_runs("", 9, 0));
    }
}
