#!/usr/bin/env bash
# CUDA checks on a GPU machine that has no Rust toolchain or registry access, from executables built
# on another x86-64 Linux machine with nvcc (tools/ci/cuda-tests.sh is the one-step version for a GPU
# machine that can build).
#
#   tools/ci/cuda-prebuilt.sh pack OUT.tar.xz [TEST ...]   # here: build, then pack the executables
#   tools/ci/cuda-prebuilt.sh run OUT.tar.xz [RESULTS_DIR] # there, in a checkout of the same commit
#
# `pack` builds a copy of this commit (a git worktree) with `--features cuda`, its candle-core patched
# from CUDA's dynamic *linking* to dynamic *loading* (cudarc's `dynamic-loading`): the binaries then
# open libcuda, cuBLAS, cuRAND and NVRTC by name at run time instead of needing the sonames of the
# build machine's CUDA (11.8 here; the GPU machine may carry another major version). It packs the
# release `edgerun` and the named test executables (default: the model parity and CLI tests), stripped, and the CUDA
# runtime library the binaries were linked with.
# `run` unpacks them, links the GPU machine's CUDA libraries where cudarc looks, recreates the paths
# compiled into the tests (the checkout, the `edgerun` binary), runs `edgerun doctor`, every packed test
# with EDGERUN_TEST_DEVICE=cuda, and tools/bench/compare_cuda.py (not with CUDA_BENCH=0).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode="${1:?usage: cuda-prebuilt.sh pack|run ARCHIVE ...}"
archive="${2:?archive path}"
shift 2

pack() {
    local tests=("$@")
    [ ${#tests[@]} -gt 0 ] || tests=(depth_anything segformer chmv2 da3 lgatr edges interpolate quantize
        batch_invariance direct_cli annotate tiling train_parity)
    local wt="${CUDA_WORKTREE:-/tmp/edgerun-cuda-worktree}" target="${CUDA_TARGET_DIR:-/tmp/edgerun-cuda-target}"
    [ -d "$wt" ] || git worktree add --detach "$wt" HEAD
    git -C "$wt" checkout --detach -q "$(git rev-parse HEAD)"
    if [ ! -d "$wt/.patch/candle-core" ]; then
        local src
        src="$(dirname "$(cargo metadata --format-version 1 --locked | python3 -c 'import json,sys; print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "candle-core"))')")"
        mkdir -p "$wt/.patch" && cp -r "$src" "$wt/.patch/candle-core"
        sed -i 's/"dynamic-linking",/"dynamic-loading",/' "$wt/.patch/candle-core/Cargo.toml"
        printf '\n[patch.crates-io]\ncandle-core = { path = ".patch/candle-core" }\n' >>"$wt/Cargo.toml"
    fi
    export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-87}" # PTX for 8.7; the driver compiles it for newer GPUs
    (cd "$wt" && cargo build --release --features cuda --target-dir "$target")
    local list
    list="$(cd "$wt" && cargo test --features cuda --target-dir "$target" --no-run --message-format=json |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')"
    local stage
    stage="$(mktemp -d)"
    mkdir -p "$stage/tests"
    strip -o "$stage/edgerun" "$target/release/edgerun"
    # candle-kernels links CUDA's runtime by soname (its MoE and quantized-matmul objects); the one
    # it was built against travels along (the runtime works with any newer driver).
    mkdir -p "$stage/lib"
    ldd "$target/release/edgerun" | awk '/libcudart/ {print $3}' | while read -r lib; do
        cp -L "$lib" "$stage/lib/$(basename "$lib")"
    done
    for t in "${tests[@]}"; do
        local exe
        exe="$(awk -v t="$t" '$1 == t {print $2}' <<<"$list")"
        [ -n "$exe" ] || { echo "no test executable named $t" >&2; exit 1; }
        strip -o "$stage/tests/$t" "$exe"
    done
    printf 'BUILT_CHECKOUT=%q\nBUILT_BIN_EXE=%q\nBUILT_COMMIT=%q\n' "$wt" "$target/debug/edgerun" "$(git rev-parse HEAD)" >"$stage/built.env"
    mkdir -p "$(dirname "$archive")"
    tar -C "$stage" -cf - . | xz -T0 --lzma2=preset=6,dict=256MiB >"$archive"
    rm -rf "$stage"
    ls -la "$archive"
}

# Links each CUDA library cudarc opens by its unversioned name into one folder on LD_LIBRARY_PATH.
link_cuda_libraries() {
    local dir=/tmp/edgerun-cuda-libs
    mkdir -p "$dir"
    for lib in cuda cublas cublasLt curand nvrtc; do
        local found
        found="$(find /usr/local/nvidia /usr/lib/x86_64-linux-gnu /usr/local/cuda* /opt /usr/local/lib -name "lib$lib.so*" -not -path "*/stubs/*" \
            -not -name "*.a" 2>/dev/null | sort -V | tail -1 || true)"
        [ -n "$found" ] || { echo "lib$lib.so not found" >&2; continue; }
        ln -sf "$found" "$dir/lib$lib.so"
        export LD_LIBRARY_PATH="$dir:$(dirname "$found"):${LD_LIBRARY_PATH:-}"
        echo "lib$lib.so -> $found"
    done
}

run() {
    local results="${1:-/tmp/edgerun-cuda-results}" unpacked=/tmp/edgerun-cuda-prebuilt
    mkdir -p "$results" "$unpacked"
    xz -dc "$archive" | tar -C "$unpacked" -xf -
    # shellcheck disable=SC1091
    . "$unpacked/built.env"
    # The tests read fixtures under their build checkout and run the binary at its build path.
    if [ ! -e "$BUILT_CHECKOUT" ]; then mkdir -p "$(dirname "$BUILT_CHECKOUT")" && ln -s "$PWD" "$BUILT_CHECKOUT"; fi
    mkdir -p "$(dirname "$BUILT_BIN_EXE")" && ln -sf "$unpacked/edgerun" "$BUILT_BIN_EXE"
    link_cuda_libraries
    export LD_LIBRARY_PATH="$unpacked/lib:$LD_LIBRARY_PATH"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$unpacked/edgerun" --version
    "$unpacked/edgerun" doctor
    local failed=()
    for t in "$unpacked"/tests/*; do
        local log=/tmp/edgerun-cuda-test.log
        echo "== test $(basename "$t") (EDGERUN_TEST_DEVICE=cuda)" | tee -a "$results/tests.log"
        EDGERUN_TEST_DEVICE=cuda "$t" >"$log" 2>&1 || true
        cat "$log" >>"$results/tests.log"
        grep -E "^test result|panicked|FAILED" "$log" | head -20 || true
        grep -q "^test result: ok" "$log" || failed+=("$(basename "$t")")
    done
    echo "failed test executables: ${failed[*]:-none}"
    [ "${CUDA_BENCH:-1}" = 0 ] || python3 tools/bench/compare_cuda.py --binary "$unpacked/edgerun" --results "$results/RESULTS-cuda.md" \
        --rounds "${CUDA_BENCH_ROUNDS:-2}" --repeat "${CUDA_BENCH_REPEAT:-10}" || echo "compare_cuda.py failed"
    [ ${#failed[@]} -eq 0 ]
}

case "$mode" in
    pack) pack "$@" ;;
    run) run "$@" ;;
    *) echo "usage: cuda-prebuilt.sh pack|run ARCHIVE ..." >&2; exit 2 ;;
esac
