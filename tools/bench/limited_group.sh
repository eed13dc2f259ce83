#!/bin/bash
# `--batch auto` under a memory limit (docs/memory.md, "Under a 700 MiB group"): runs edgerun in a cgroup
# v1 memory group of 700 MiB and prints each run's plan, exit, the group's peak and peak RSS, and whether
# the outputs equal a batch-1 run's. Needs root and a writable cgroup v1 memory controller.
# Usage: limited_group.sh MODEL_DIR IMAGE_DIR [WORK_DIR] (EDGERUN=binary, OLD=an older binary to compare)
set -u
M=${1:?model directory (a full-size DA-V2-Small: tools/bench/compare.py build_da2s)}
I=${2:?a directory of images (24 of 1024x768 in docs/memory.md)}
W=${3:-/tmp/edgerun-limited-group}
B=${EDGERUN:-target/release/edgerun}
OLD=${OLD:-}
P=/sys/fs/cgroup/memory$(grep ':memory:' /proc/self/cgroup | cut -d: -f3)
G=$P/edgerun-limited-$$
rm -rf $W; mkdir -p $W
rmdir $G 2>/dev/null; mkdir $G
echo $((700<<20)) > $G/memory.limit_in_bytes
ingroup() { sh -c "echo \$\$ > $G/cgroup.procs; exec \"\$@\"" sh "$@"; }
run() { # name, command...
  name=$1; shift
  echo 0 > $G/memory.max_usage_in_bytes 2>/dev/null; echo 0 > $G/memory.force_empty 2>/dev/null
  k0=$(grep oom_kill /proc/vmstat | cut -d' ' -f2)
  ingroup /usr/bin/time -v "$@" > $W/$name.out 2> $W/$name.err; rc=$?; last_rc=$rc
  k1=$(grep oom_kill /proc/vmstat | cut -d' ' -f2)
  echo "== $name: exit $rc, group peak $(( $(cat $G/memory.max_usage_in_bytes) >> 20 )) MiB, RSS $(( $(grep 'Maximum resident' $W/$name.err | awk '{print $6}') >> 10 )) MiB, oom kills $((k1-k0)), $(grep 'Elapsed' $W/$name.err | awk '{print $8}')"
  grep -E "memory budget|batch auto|stopped during|at most|killed for memory|done,|out of memory" $W/$name.err | grep -v "^\s*Command" | sed 's/^/   /'
}
[ -n "$OLD" ] && run old-depth-auto $OLD depth --model $M --device cpu --progress none $I --out $W/old-depth-auto
run depth-auto $B depth --model $M --device cpu --progress none $I --out $W/depth-auto
run depth-b1 $B depth --model $M --device cpu --batch 1 --progress none $I --out $W/depth-b1
rm -f $W/depth-auto/.edgerun-depth.passes.jsonl $W/depth-b1/.edgerun-depth.passes.jsonl
diff -r $W/depth-auto $W/depth-b1 > /dev/null && echo "depth: auto and --batch 1 outputs byte-identical ($(ls $W/depth-auto | wc -l) files)" || echo "depth: OUTPUTS DIFFER"
run annotate-auto $B annotate --stages depth,edges --model depth=$M --device cpu --progress none $I $W/ann-auto
run annotate-b1 $B annotate --stages depth,edges --model depth=$M --device cpu --batch 1 --progress none $I $W/ann-b1
diff -r $W/ann-auto/depth $W/ann-b1/depth >/dev/null && diff -r $W/ann-auto/edges $W/ann-b1/edges >/dev/null && echo "annotate: auto and batch 1 outputs byte-identical" || echo "annotate: OUTPUTS DIFFER"
# The planner forced high (8 per pass needs ~1.25 GiB here): the kernel kills; reruns converge.
for r in 1 2 3 4 5 6; do
  run annotate-forced-$r env EDGERUN_PLAN_BATCH=8 $B annotate --stages depth,edges --model depth=$M --device cpu --progress none $I $W/ann-forced
  [ "$last_rc" = 0 ] && break
done
diff -r $W/ann-forced/depth $W/ann-b1/depth >/dev/null && diff -r $W/ann-forced/edges $W/ann-b1/edges >/dev/null && echo "annotate forced: outputs byte-identical to batch 1" || echo "annotate forced: OUTPUTS DIFFER"
for s in depth edges; do echo "$s journal: $(grep -c . $W/ann-forced/manifests/$s.jsonl) records, $(grep -o '"input":"[^"]*"' $W/ann-forced/manifests/$s.jsonl | sort -u | wc -l) distinct inputs, $(grep -c '"status":"failed"' $W/ann-forced/manifests/$s.jsonl) failed"; done
run doctor $B doctor; grep "memory budget" -A2 $W/doctor.out
rmdir $G
