#!/usr/bin/env bash
# Seeds and runs every fuzz target for a bounded time: fuzz/run.sh [seconds per target, default 120].
# Seeds: corpus-seeds/<target> (tiny valid files; the weight-file ones are regenerated from the
# repository root with `cargo run --example fuzz_seeds`, and `cargo test --test malformed` checks they are
# current; config_model seeds are a model-pick byte + a JSON patch of that model's config, npy_reader
# seeds small .npy files, gguf_metadata seeds a count byte + metadata key/values, finetune_state seeds
# small resume states written by `edgerun finetune`). Dictionaries: dicts/<target>.dict when present.
# finetune_state writes its input to a temp file each run: TMPDIR=/dev/shm makes it ~10x faster.
# Needs a nightly toolchain and cargo-fuzz (`cargo +nightly install cargo-fuzz`). Fails on a crash.
set -uo pipefail
cd "$(dirname "$0")"
secs="${1:-120}"
status=0
for t in safetensors_header gguf_header gguf_metadata store_load config_model npy_reader finetune_state; do
    echo "== $t (${secs}s)"
    log="artifacts/$t.log"
    mkdir -p artifacts "corpus/$t"
    dict=()
    [ -f "dicts/$t.dict" ] && dict=(-dict="dicts/$t.dict")
    cargo +nightly fuzz run -O -a "$t" "corpus/$t" "corpus-seeds/$t" -- -max_total_time="$secs" -max_len=8192 -timeout=10 -rss_limit_mb=2048 "${dict[@]}" >"$log" 2>&1
    rc=$?
    grep -E "^#[0-9]+\s+(INITED|DONE)|Done [0-9]+ runs" "$log" | tail -2
    if [ $rc -ne 0 ]; then
        echo "!! $t failed (exit $rc), see $log and artifacts/$t/"
        grep -E "panicked|ERROR|SUMMARY" "$log" | head -5
        status=1
    fi
done
exit $status
