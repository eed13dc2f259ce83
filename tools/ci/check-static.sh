#!/usr/bin/env bash
# Checks that a binary is a static ELF executable for the given machine and within the size budget.
#   tools/ci/check-static.sh BINARY x86-64|aarch64 [MAX_BYTES]     (default 15 MB)
# Reads the ELF header itself (no `file`/readelf needed): the machine field, and no PT_INTERP
# program header, i.e. no dynamic loader, so no shared library can be loaded at start.
set -euo pipefail
bin=$1 arch=$2 max=${3:-15000000}
[ -x "$bin" ] || { echo "check-static: $bin is not an executable" >&2; exit 1; }
u() { od -An -t "u$2" -j "$1" -N "$2" "$bin" | tr -d ' '; }
[ "$(od -An -c -j 1 -N 3 "$bin" | tr -d ' ')" = ELF ] || { echo "check-static: $bin is not ELF" >&2; exit 1; }
[ "$(u 4 1)" = 2 ] || { echo "check-static: $bin is not a 64-bit ELF" >&2; exit 1; }
case $arch in x86-64) want=62 ;; aarch64) want=183 ;; *) echo "check-static: unknown arch $arch" >&2; exit 2 ;; esac
machine=$(u 18 2)
[ "$machine" = "$want" ] || { echo "check-static: $bin is for ELF machine $machine, not $arch ($want)" >&2; exit 1; }
phoff=$(u 32 8) phentsize=$(u 54 2) phnum=$(u 56 2)
for ((i = 0; i < phnum; i++)); do
    if [ "$(u $((phoff + i * phentsize)) 4)" = 3 ]; then
        echo "check-static: $bin has a PT_INTERP header: it is dynamically linked" >&2
        exit 1
    fi
done
size=$(stat -c %s "$bin")
[ "$size" -le "$max" ] || { echo "check-static: $bin is $size bytes, over the $max budget" >&2; exit 1; }
echo "check-static: $bin: static $arch ELF, $size bytes (budget $max)"
if command -v file >/dev/null; then file -b "$bin"; fi
