//! Records the git revision and enabled features for `edgerun --version`, and with `cuda` the GPU
//! architecture Candle's kernels are built for.
use std::process::Command;

fn main() {
    let hash = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into());
    let features: Vec<&str> = ["cuda", "cudnn", "metal"]
        .into_iter()
        .filter(|f| std::env::var(format!("CARGO_FEATURE_{}", f.to_uppercase())).is_ok())
        .collect();
    let backends = std::iter::once("cpu")
        .chain(features.iter().copied().filter(|f| *f != "cudnn"))
        .collect::<Vec<_>>()
        .join(", ");
    let features = if features.is_empty() { "none".to_string() } else { features.join(", ") };
    println!(
        "cargo:rustc-env=EDGERUN_LONG_VERSION={} (git {hash}, target {}, features: {features}, backends: {backends})",
        std::env::var("CARGO_PKG_VERSION").unwrap_or_default(),
        std::env::var("TARGET").unwrap_or_default()
    );
    if std::env::var("CARGO_FEATURE_CUDA").is_ok() {
        // The GPU architecture Candle's CUDA kernels are compiled for, found as their build finds it.
        let cap = std::env::var("CUDA_COMPUTE_CAP").ok().or_else(|| {
            Command::new("nvidia-smi")
                .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
                .output()
                .ok()
                .and_then(|o| String::from_utf8(o.stdout).ok())
                .and_then(|s| s.lines().next().map(|l| l.trim().replace('.', "")))
        });
        if let Some(cap) = cap {
            println!("cargo:rustc-env=EDGERUN_CUDA_COMPUTE_CAP={cap}");
        }
        println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    }
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
}
