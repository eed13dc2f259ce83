#!/usr/bin/env bash
# Latency of `annotate --watch` (docs/watch.md, "Measured latency"): a generator copies the bundled
# example images into a watched directory at RATE frames per second (each under a hidden temporary
# name, renamed into place), N frames, then the run ends by --idle-exit; prints the per-stage p50 / p95
# from arrival to output and the throughput from status.json.
# Usage: tools/bench/watch_latency.sh RATE N [CONFIG] [extra annotate flags…]
#   EDGERUN=binary (default target/release/edgerun); run from the repository root.
set -euo pipefail
rate=${1:?frames per second}; n=${2:?number of frames}; cfg=${3:-examples/annotate.toml}; shift $(( $# < 3 ? $# : 3 ))
bin=${EDGERUN:-target/release/edgerun}
work=$(mktemp -d /tmp/edgerun-watch-latency.XXXXXX)
mkdir -p "$work/in"
"$bin" annotate --watch --config "$cfg" --progress none --idle-exit 3 "$@" "$work/in" "$work/out" 2> "$work/stderr" &
pid=$!
# Frames start once the models could have loaded (they load at the first frame: that one's latency
# includes the load).
sleep 1
imgs=(examples/images/*)
period=$(awk -v r="$rate" 'BEGIN { printf "%.4f", 1 / r }')
start=$(date +%s.%N)
for ((i = 0; i < n; i++)); do
    src=${imgs[$((i % ${#imgs[@]}))]}
    ext=${src##*.}
    name=$(printf 'frame_%05d.%s' "$i" "$ext")
    cp "$src" "$work/in/.$name.part"
    mv "$work/in/.$name.part" "$work/in/$name"
    # Keep the schedule: sleep until frame i+1 is due.
    next=$(awk -v s="$start" -v i="$i" -v p="$period" 'BEGIN { printf "%.4f", s + (i + 1) * p }')
    now=$(date +%s.%N)
    delay=$(awk -v a="$next" -v b="$now" 'BEGIN { d = a - b; printf "%.4f", (d > 0 ? d : 0) }')
    sleep "$delay"
done
wait "$pid" || { cat "$work/stderr"; exit 1; }
echo "rate $rate/s, $n frames, config $cfg $*"
awk '/"(done|failed|skipped_backlog|frames_per_s_total)"|"latency_p(50|95)_s"|"depth"|"edges"|"segmentation"|"chm"|"model"|"device"/' "$work/out/status.json"
rm -rf "$work"
