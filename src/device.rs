//! Device selection (`--device cpu|cuda[:N]|metal|auto`) and compute dtype parsing.
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Resolves a `--device` argument. `auto` picks a compiled-in GPU when one is present, else the CPU.
pub fn parse_device(spec: &str) -> Result<Device> {
    let spec = spec.trim().to_ascii_lowercase();
    match spec.as_str() {
        "auto" => Ok(auto_device()),
        "cpu" => Ok(Device::Cpu),
        "metal" => metal(0),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let ordinal = match s.strip_prefix("cuda:") {
                None => 0,
                Some(n) => n.parse::<usize>().map_err(|_| Error::Device(format!("bad CUDA ordinal in `{spec}`")))?,
            };
            cuda(ordinal)
        }
        _ => Err(Error::Device(format!("unknown device `{spec}` (expected cpu, cuda, cuda:N, metal or auto)"))),
    }
}

fn auto_device() -> Device {
    if candle_core::utils::cuda_is_available() {
        if let Ok(d) = cuda(0) {
            return d;
        }
    }
    if candle_core::utils::metal_is_available() {
        if let Ok(d) = Device::new_metal(0) {
            return d;
        }
    }
    Device::Cpu
}

fn cuda(ordinal: usize) -> Result<Device> {
    if !cfg!(feature = "cuda") {
        return Err(Error::Device("CUDA was requested but this edgerun was built without the `cuda` feature".into()));
    }
    let device = Device::new_cuda(ordinal)
        .map_err(|e| Error::Device(format!("cannot open CUDA device {ordinal}: {}", Error::candle_message(&e))))?;
    crate::cuda_arch::adapt_quantized_matmuls(&device);
    Ok(device)
}

fn metal(ordinal: usize) -> Result<Device> {
    if !cfg!(feature = "metal") {
        return Err(Error::Device("Metal was requested but this edgerun was built without the `metal` feature".into()));
    }
    Device::new_metal(ordinal).map_err(|e| Error::Device(format!("cannot open Metal device {ordinal}: {}", Error::candle_message(&e))))
}

/// Parses a `--dtype` argument (`f32`, `f16`, `bf16`).
pub fn parse_dtype(spec: &str) -> Result<DType> {
    match spec.trim().to_ascii_lowercase().as_str() {
        "f32" | "float32" => Ok(DType::F32),
        "f16" | "float16" | "half" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => Err(Error::Device(format!("unknown dtype `{other}` (expected f32, f16 or bf16)"))),
    }
}

/// Whether Candle can run `dtype` on `device` (its CPU backend has no bf16 matmul or conv).
pub fn check_dtype(device: &Device, dtype: DType) -> Result<()> {
    if device.is_cpu() && dtype == DType::BF16 {
        return Err(Error::Device("bf16 is not available on the CPU (Candle has no bf16 matmul/conv there); use f32 or f16, or a GPU".into()));
    }
    Ok(())
}

/// Sets the number of CPU threads used by Candle's thread pools (call before any tensor work).
pub fn set_threads(n: usize) {
    // Both variables are read once, when Candle's pools start; this runs before any tensor op.
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    std::env::set_var(CANDLE_THREADS_VAR, candle_barrier_pool_threads(n).to_string());
}

/// The variable that sets how long a worker of Candle's barrier pool spins before it sleeps.
const CANDLE_SPIN_VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
/// The variable that sets the threads of Candle's barrier pool (the calling thread included).
const CANDLE_THREADS_VAR: &str = "CANDLE_NUM_THREADS";

/// Threads for Candle's barrier pool (its element-wise ops) when the kernels run on `threads`: on
/// two threads or fewer only the calling thread. Handing each small op to the pool's worker and
/// waiting for it cost more than the op saved on 2 cores: L-GATr ran 12.5 % faster without the
/// worker (hundreds of small ops per forward), SegFormer-B0 ~10 %, the ViTs and fine-tuning
/// within noise. Not measured on more cores, where the pool keeps one thread per core.
fn candle_barrier_pool_threads(threads: usize) -> usize {
    if threads <= 2 {
        1
    } else {
        threads
    }
}

/// Quiets Candle's barrier pool unless the user set its variables: its worker sleeps as soon as
/// an op is done (by default it spins 25,000 pauses first, taking a core from the rayon kernels
/// that usually run next: on 2 cores, without the spin, SegFormer-B0 ran 5 % faster, DA-V2-Small
/// and L-GATr 3.5 %), and on two threads or fewer the pool has no worker at all
/// ([`candle_barrier_pool_threads`]). Call before any tensor work.
pub fn quiet_candle_barrier_pool() {
    if std::env::var_os(CANDLE_SPIN_VAR).is_none() {
        std::env::set_var(CANDLE_SPIN_VAR, "0");
    }
    if std::env::var_os(CANDLE_THREADS_VAR).is_none() {
        let threads = candle_barrier_pool_threads(candle_core::utils::get_num_threads());
        std::env::set_var(CANDLE_THREADS_VAR, threads.to_string());
    }
}

/// Runs `f` on a worker thread of the global rayon pool when `device` is the CPU (else where it is:
/// a GPU context belongs to the calling thread) and returns its result. From a worker the kernels'
/// parallel loops share their work with the pool's other workers directly; called from outside the
/// pool, each loop would wake the pool's workers and put the caller to sleep until they are done
/// (three thread switches per loop, many per forward pass). Inside the pool it runs `f` where it is.
pub fn on_pool_worker<R: Send>(device: &Device, f: impl FnOnce() -> R + Send) -> R {
    if !device.is_cpu() || rayon::current_thread_index().is_some() {
        return f();
    }
    rayon::scope(|_| f())
}

/// A tensor with no elements of `shape` (some dimension 0) on `device`. Candle's CUDA backend cannot
/// allocate zero bytes (`CUDA_ERROR_INVALID_VALUE`), so there it is a zero-length view of a
/// one-element-deep buffer.
pub fn empty_tensor(shape: &[usize], dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    if device.is_cpu() {
        return Tensor::zeros(shape, dtype, device);
    }
    let backing: Vec<usize> = shape.iter().map(|&d| d.max(1)).collect();
    let mut t = Tensor::zeros(backing, dtype, device)?;
    for (dim, &d) in shape.iter().enumerate() {
        if d == 0 {
            t = t.narrow(dim, 0, 0)?;
        }
    }
    Ok(t)
}
