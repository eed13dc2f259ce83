#!/usr/bin/env bash
# Adds Debian archive components (e.g. `contrib non-free`) to the apt sources this machine already
# has, whatever mirror they point to: the `Components:` field of each Debian stanza in deb822
# `/etc/apt/sources.list.d/*.sources` files, and each Debian `deb` line of one-line `.list` files.
# No mirror or host is named here. Exits non-zero, saying why, when no Debian source is configured.
#
#   tools/ci/apt-components.sh contrib non-free non-free-firmware
set -euo pipefail
[ "$#" -gt 0 ] || { echo "usage: $0 COMPONENT..." >&2; exit 2; }
want="$*"
apt="${APT_DIR:-/etc/apt}"   # another root for testing
shopt -s nullglob
touched=0

# deb822: stanzas are separated by blank lines; a stanza is Debian's when a URI path ends in
# /debian or /debian-security (any mirror).
for f in "$apt"/sources.list.d/*.sources; do
    tmp=$(mktemp)
    awk -v want="$want" '
        function flush(   i, n, w, have, line, extra) {
            if (nlines == 0) return
            if (debian && comp_at > 0) {
                line = lines[comp_at]; sub(/^Components:[ \t]*/, "", line)
                n = split(line, have, /[ \t]+/); extra = ""
                split(want, w, " ")
                for (i in w) { found = 0; for (j = 1; j <= n; j++) if (have[j] == w[i]) found = 1; if (!found) extra = extra " " w[i] }
                if (extra != "") { lines[comp_at] = lines[comp_at] extra; changed = 1 }
                touched = 1
            }
            for (i = 1; i <= nlines; i++) print lines[i]
            nlines = 0; debian = 0; comp_at = 0
        }
        /^[ \t]*$/ { flush(); print; next }
        { lines[++nlines] = $0 }
        /^URIs[:]/ && $0 ~ /\/debian(-security)?\/?([ \t]|$)/ { debian = 1 }
        /^Components:/ { comp_at = nlines }
        END { flush(); exit touched ? 0 : 3 }
    ' "$f" > "$tmp" && rc=0 || rc=$?
    if [ "$rc" = 0 ]; then
        cat "$tmp" > "$f"
        touched=1
        echo "apt-components: $f now has: $want"
    fi
    rm -f "$tmp"
done

# One-line format: `deb [opts] URI SUITE COMPONENT...`.
for f in "$apt"/sources.list "$apt"/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    grep -qE '^deb(-src)?[[:space:]].*/debian(-security)?/?[[:space:]]' "$f" || continue
    for c in $want; do
        sed -i -E "/^deb(-src)?[[:space:]].*\/debian(-security)?\/?[[:space:]]/{/[[:space:]]$c([[:space:]]|\$)/!s/\$/ $c/}" "$f"
    done
    touched=1
    echo "apt-components: $f now has: $want"
done

if [ "$touched" = 0 ]; then
    echo "apt-components: no Debian package source found in $apt/sources.list or $apt/sources.list.d/ to add '$want' to; add them to your configured Debian source by hand" >&2
    exit 1
fi
