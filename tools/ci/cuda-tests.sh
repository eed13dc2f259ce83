#!/usr/bin/env bash
# Runs the test suite on a CUDA GPU: model tests on EDGERUN_TEST_DEVICE (default cuda), CLI and
# annotate tests with the same device (`--device`, the config's `device`); the CPU-kernel tests
# (depthwise, L-GATr kernels) stay on the CPU. Usage: tools/ci/cuda-tests.sh [cuda:N]
set -euo pipefail
cd "$(dirname "$0")/../.."
export EDGERUN_TEST_DEVICE="${1:-cuda}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}"
cargo build --release --locked --features cuda
./target/release/edgerun doctor
cargo test --locked --features cuda
