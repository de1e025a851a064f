#!/usr/bin/env bash
# Carry a wheel set larger than the device call's 64 MiB limit (JAX 0.12.1 with its CUDA 13
# plugin: 226 MB; the CuTe DSL's CUDA libraries: 92 MB) in parts, one part per call, to a
# machine that stays warm between calls.
#   here:    bash benchmarks/tools/wheel_parts.sh split WHEEL_DIR PARTS_PREFIX [MiB per part]
#            -> PARTS_PREFIX1/ ... PARTS_PREFIXn/ (git-ignore them), each a carry path
#   device:  bash benchmarks/tools/wheel_parts.sh stash PARTS_PREFIX   (each call: its part
#            to /tmp/wheel_parts, which lives as long as the machine)
#            bash benchmarks/tools/wheel_parts.sh install SITE_DIR   (after the last part:
#            checks every wheel's sha256, then pip install --no-deps --target SITE_DIR)
# Then put SITE_DIR first on PYTHONPATH (gpu_tests.sh: EXTRA_SITE=SITE_DIR).
set -euo pipefail
store=/tmp/wheel_parts
case "${1:-}" in
    split)
        wheels=$2 prefix=$3 mib=${4:-48}
        tmp=$(mktemp -d)
        (cd "$wheels" && ls *.whl) > "$tmp/ORDER"
        (cd "$wheels" && sha256sum $(cat "$tmp/ORDER")) > "$tmp/SHA256"
        (cd "$wheels" && for w in $(cat "$tmp/ORDER"); do echo "$w $(stat -c %s "$w")"; done) \
            > "$tmp/SIZES"
        (cd "$wheels" && cat $(cat "$tmp/ORDER")) | split -b "${mib}M" -d -a 2 - "$tmp/part."
        i=1
        for part in "$tmp"/part.*; do
            mkdir -p "$prefix$i" && mv "$part" "$prefix$i/"
            i=$((i + 1))
        done
        cp "$tmp/SIZES" "$tmp/SHA256" "${prefix}1/" && rm -rf "$tmp"
        ls -d "$prefix"*
        ;;
    stash)
        mkdir -p "$store" && cp "$2"*/* "$store/" && ls -l "$store"
        ;;
    install)
        site=$2
        cd "$store"
        cat part.* > all.bin
        offset=0
        while read -r name size; do
            tail -c +$((offset + 1)) all.bin | head -c "$size" > "$name"
            offset=$((offset + size))
        done < SIZES
        rm all.bin
        sha256sum -c SHA256
        python3 -m pip install -q --no-deps --target "$site" $(cut -d' ' -f1 SIZES)
        echo "installed into $site: $(cut -d' ' -f1 SIZES | tr '\n' ' ')"
        ;;
    *)
        sed -n 2,11p "$0" >&2
        exit 2
        ;;
esac
