"""Batch sizes `--batch auto` picks at given memory budgets, and the peak RSS of each run (issue #13).

Usage (from the repo root, after `cargo build --release`):
    /work/venv/bin/python tools/bench/budget.py [--binary target/release/edgerun] [--budgets 1024 2048 4096]
It writes (or reuses) the full-size random-weight checkpoints of tools/bench/memory.py (DA-V2-Small,
SegFormer-B0, CHMv2) under --workdir, a folder of full-size PNG images per model, then runs
`edgerun depth|segment|chm --batch auto --mem-budget MiB` on it under /usr/bin/time for each budget and
prints one markdown row per model and budget: the planned batch and per-image estimate (from the run's
log line), the batch sizes actually run, wall time and peak RSS ("Maximum resident set size").
A fixed `--batch 1` run per model gives the per-image cost the estimate is compared with.
"""
import argparse
import os
import re
import subprocess
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
from chmv2 import fixtures_reinit  # noqa: E402
from memory import build  # noqa: E402

COMMANDS = {"da2s": ("depth", 518, 16), "segb0": ("segment", 512, 48), "chmv2": ("chm", 416, 4)}
NAMES = {"da2s": "DA-V2-Small 518²", "segb0": "SegFormer-B0 512²", "chmv2": "CHMv2 416²"}


def images(d, side, n):
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        p = os.path.join(d, f"img_{i:03d}.png")
        if not os.path.exists(p):
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(p)


def run(binary, cmd, model, inputs, out, extra):
    args = ["/usr/bin/time", "-f", "%M %e", binary, cmd, "--model", model, inputs, "--out", out, "--device", "cpu",
            "--progress", "lines"] + extra
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{p.stderr[-2000:]}")
    rss_kib, wall = p.stderr.strip().splitlines()[-1].split()
    plan = re.search(r"up to (\d+) per pass \(budget (\d+) MiB, about (\d+) MiB per image\)", p.stderr)
    return int(rss_kib) / 1024, float(wall), plan.groups() if plan else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/memory")
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--models", nargs="+", default=["da2s", "segb0", "chmv2"])
    ap.add_argument("--budgets", nargs="+", type=int, default=[1024, 2048, 4096])
    a = ap.parse_args()
    torch.manual_seed(0)
    print("| model | budget MiB | planned batch | estimate MiB / image | peak RSS MiB | wall s |")
    print("|---|---|---|---|---|---|")
    for name in a.models:
        cmd, side, n = COMMANDS[name]
        d = os.path.join(a.workdir, name)
        if not os.path.exists(os.path.join(d, "model.safetensors")):
            model, _, _ = build(name)
            fixtures_reinit()(model.eval(), 0)
            model.save_pretrained(d)
        inputs = os.path.join(a.workdir, f"{name}_images")
        images(inputs, side, n)
        out = os.path.join(a.workdir, f"{name}_out")
        rss1, wall1, _ = run(a.binary, cmd, d, inputs, out, ["--batch", "1"])
        print(f"| {NAMES[name]} | (fixed batch 1) | 1 | | {rss1:.0f} | {wall1:.1f} |", flush=True)
        for b in a.budgets:
            rss, wall, plan = run(a.binary, cmd, d, inputs, out, ["--batch", "auto", "--mem-budget", str(b)])
            batch, _, est = plan if plan else ("?", "", "?")
            print(f"| {NAMES[name]} | {b} | {batch} | {est} | {rss:.0f} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
