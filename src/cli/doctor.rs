//! `edgerun doctor [--models DIR]`: what this machine and build can do.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use argh::FromArgs;
use candle_core::utils;
use candle_core::{DType, Device};
use edgerun::runner::MemoryBudget;
use edgerun::weights::WeightStore;

use super::common::outln;

/// Report devices, memory, threads, CPU features and whether models load.
#[derive(FromArgs, Debug)]
#[argh(subcommand, name = "doctor")]
pub struct Args {
    /// a directory of models (sub-directories and `.gguf` files) to try loading
    #[argh(option)]
    models: Option<PathBuf>,
}

fn mem_total() -> Option<String> {
    let bytes = edgerun::memory::available::mem_total()?;
    Some(format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64))
}

fn try_load(path: &Path) -> Result<String, String> {
    let store = WeightStore::open(path).map_err(|e| e.to_string())?;
    let arch = edgerun::models::architecture(&store).unwrap_or_else(|| "?".into());
    let n = store.entries().len();
    edgerun::models::load(Arc::new(store), &Device::Cpu, DType::F32).map_err(|e| e.to_string())?;
    Ok(format!("{arch}, {n} tensors"))
}

/// Runs `doctor`.
pub fn run(a: Args) -> anyhow::Result<()> {
    outln!("edgerun {}", env!("EDGERUN_LONG_VERSION"));
    outln!("cpu threads:   {} (candle), {} logical cores", utils::get_num_threads(), std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    outln!("cpu features:  avx={} neon={} simd128={} f16c={}", utils::with_avx(), utils::with_neon(), utils::with_simd128(), utils::with_f16c());
    let int8_gemm = match edgerun::kernels::int8_gemm::Kernel::detect() {
        Some(edgerun::kernels::int8_gemm::Kernel::Avx512Vnni) => "AVX-512 VNNI",
        Some(edgerun::kernels::int8_gemm::Kernel::AvxVnni) => "AVX-VNNI",
        None => "none",
    };
    let int8_attention = if edgerun::kernels::amx::available() { "AMX" } else { "none (f32)" };
    outln!("int8 (Q8_0, Q4_K): GEMM {int8_gemm}, attention {int8_attention}");
    let f16_matrices = if edgerun::kernels::amx::bf16_available() { "AMX-BF16 tiles (split into bf16 pairs, f32 sums)" } else { "widened to f32 per product" };
    outln!("f16 matrices:  {f16_matrices}");
    outln!("memory:        {}", mem_total().unwrap_or_else(|| "unknown".into()));
    budget_lines(&Device::Cpu, "cpu")?;
    if cfg!(feature = "cuda") && utils::cuda_is_available() {
        if let Ok(d) = edgerun::device::parse_device("cuda") {
            budget_lines(&d, "cuda")?;
        }
    }
    outln!("cuda:          {}", if !cfg!(feature = "cuda") { "not compiled in".to_string() } else if utils::cuda_is_available() { match edgerun::device::parse_device("cuda") { Ok(d) => cuda_line(&d), Err(e) => format!("compiled in, {e}") } } else { "compiled in, no device".into() });
    outln!("metal:         {}", if !cfg!(feature = "metal") { "not compiled in" } else if utils::metal_is_available() { "available" } else { "compiled in, no device" });
    outln!("architectures: {}", edgerun::models::architectures().join(", "));
    if let Some(dir) = a.models {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir).map_err(|e| edgerun::Error::io(&dir, e)).context("cannot read --models")?.filter_map(|e| e.ok().map(|e| e.path())).collect();
        entries.sort();
        let mut failed = 0;
        for p in entries.iter().filter(|p| p.is_dir() || p.extension().is_some_and(|e| e == "gguf")) {
            match try_load(p) {
                Ok(s) => outln!("model ok:      {} ({s})", p.display()),
                Err(e) => {
                    failed += 1;
                    outln!("model FAILED:  {}: {e}", p.display())
                }
            }
        }
        anyhow::ensure!(failed == 0, "{failed} model(s) failed to load");
    }
    Ok(())
}

/// The `--batch auto` budget of `device` and where it came from; on the CPU the other figures looked
/// at (each cgroup limit, `MemAvailable`) and what was ignored.
fn budget_lines(device: &Device, name: &str) -> anyhow::Result<()> {
    match MemoryBudget::explain(None, device) {
        Ok((_, why)) => outln!("memory budget: {name} {why}"),
        Err(e) => outln!("memory budget: {name} unknown ({e})"),
    }
    if device.is_cpu() {
        for other in edgerun::memory::cpu_available().map(|a| a.others).unwrap_or_default() {
            outln!("               also {other}");
        }
    }
    Ok(())
}

/// Device 0's capability against the one Candle's machine-code kernels were built for.
fn cuda_line(device: &candle_core::Device) -> String {
    use edgerun::cuda_arch;
    let cap = cuda_arch::capability(device).map_or("unknown".into(), |(a, b)| format!("{a}.{b}"));
    let built = cuda_arch::BUILT_FOR.unwrap_or("unknown");
    let quantized = if cuda_arch::machine_code_runs_on(device) { "fast quantized kernels" } else { "quantized matmuls dequantize (kernels built for another GPU)" };
    format!("available (device 0 opened, compute capability {cap}; kernels built for {built}: {quantized})")
}
