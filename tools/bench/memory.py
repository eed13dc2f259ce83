"""Peak RSS of `edgerun forward` against the weights it holds (docs/memory.md).

Usage (from the repo root, after `cargo build --release`):
    /work/venv/bin/python tools/bench/memory.py [--binary target/release/edgerun] [--models da2s segb0 chmv2]
It writes full-size random-weight checkpoints (DA-V2-Small, SegFormer-B0 with 150 labels, CHMv2: 1.35 GB;
not committed) and their Q8_0 / Q4K GGUF copies to --workdir, then runs `edgerun forward` under
/usr/bin/time on a full-size input and on a minimal one (32×32, 28×28 for DA-V2) and prints one markdown row
per model and format:
  weights: the file's tensor bytes, and what they take in memory at f32 compute (plain floats widened to
           f32, quantized blocks as stored);
  peak:    "Maximum resident set size" of the full-size run;
  small:   the same for the minimal input (weights + load transients + the process floor);
  act.:    full − small (the activations of the full-size input) plus the floor, measured as the peak of a
           forward pass of the tiny SegFormer fixture on 32×32;
  ratio:   peak / (weights in memory + act.); docs/memory.md's target is ≤ 1.10.
Pass --binary twice as `--before OLD_BINARY` to add the peak of another build (e.g. the previous commit).
"""
import argparse
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import save_file
from transformers import (CHMv2Config, CHMv2ForDepthEstimation, DepthAnythingForDepthEstimation, SegformerConfig,
                          SegformerForSemanticSegmentation)

sys.path.insert(0, os.path.dirname(__file__))
from chmv2 import fixtures_reinit  # noqa: E402
from depth_anything import da2_small_config  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NAMES = {"da2s": "DA-V2-Small 518²", "segb0": "SegFormer-B0 512²", "chmv2": "CHMv2 416²"}


def build(name):
    """(model, full input side, minimal input side) at the real config, random weights."""
    if name == "da2s":
        return DepthAnythingForDepthEstimation(da2_small_config()), 518, 28
    if name == "segb0":
        labels = {i: f"class_{i}" for i in range(150)}
        cfg = SegformerConfig(num_labels=150, id2label=labels, label2id={v: k for k, v in labels.items()})
        return SegformerForSemanticSegmentation(cfg), 512, 32
    if name == "chmv2":
        return CHMv2ForDepthEstimation(CHMv2Config()), 416, 32
    raise SystemExit(f"unknown model {name} (da2s, segb0, chmv2)")


def peak_mib(binary, model, inp):
    """Peak RSS in MiB of one `edgerun forward` run."""
    out = inp + ".out.safetensors"
    cmd = ["/usr/bin/time", "-f", "%M", binary, "forward", "--model", model, "--input", inp, "--output", out,
           "--device", "cpu"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(p.stderr.strip().splitlines()[-1]) / 1024


def weights_mib(binary, model):
    """(tensor bytes in the file, bytes held at f32 compute) in MiB."""
    j = json.loads(subprocess.run([binary, "inspect", "--json", model], capture_output=True, text=True,
                                  check=True).stdout)
    held = 0
    for t in j["tensors"]:
        n = 1
        for d in t["shape"]:
            n *= d
        held += 4 * n if t["dtype"] in ("f32", "f16", "bf16") else t["bytes"]
    return j["total_bytes"] / 2**20, held / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/memory")
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--before", help="another edgerun binary whose peak to show next to --binary's")
    ap.add_argument("--models", nargs="+", default=["da2s", "segb0", "chmv2"])
    ap.add_argument("--variants", nargs="+", default=["f32", "q8_0", "q4k"])
    a = ap.parse_args()
    torch.manual_seed(0)
    tiny = os.path.join(a.workdir, "tiny_32.safetensors")
    os.makedirs(a.workdir, exist_ok=True)
    save_file({"pixel_values": torch.randn(1, 3, 32, 32)}, tiny)
    floor = peak_mib(a.binary, os.path.join(REPO, "tests", "fixtures", "segformer_tiny"), tiny)
    print(f"process floor (tiny SegFormer fixture, 32×32): {floor:.1f} MiB")
    print("| model | format | weights file MiB | in memory MiB |" + (" peak before |" if a.before else "")
          + " peak MiB | peak − weights | small | act. + floor | ratio |")
    print("|---|---|---|---|" + ("---|" if a.before else "") + "---|---|---|---|---|")
    for name in a.models:
        d = os.path.join(a.workdir, name)
        model, full, small = build(name)
        if not os.path.exists(os.path.join(d, "model.safetensors")):
            fixtures_reinit()(model.eval(), 0)
            model.save_pretrained(d)
        inputs = {}
        for side in (full, small):
            inputs[side] = os.path.join(a.workdir, f"{name}_{side}.safetensors")
            save_file({"pixel_values": torch.randn(1, 3, side, side)}, inputs[side])
        for v in a.variants:
            m = d if v == "f32" else os.path.join(a.workdir, f"{name}_{v}.gguf")
            if not os.path.exists(m):
                subprocess.run([a.binary, "quantize", d, m, "--type", v, "--quiet"], check=True, stdout=subprocess.DEVNULL)
            file_mib, held = weights_mib(a.binary, m)
            peak, low = peak_mib(a.binary, m, inputs[full]), peak_mib(a.binary, m, inputs[small])
            act = peak - low + floor
            before = f" {peak_mib(a.before, m, inputs[full]):.0f} |" if a.before else ""
            fmt = "safetensors f32" if v == "f32" else f"GGUF {v}"
            print(f"| {NAMES[name]} | {fmt} | {file_mib:.1f} | {held:.1f} |{before} {peak:.0f} | {peak - held:.0f} | "
                  f"{low:.0f} | {act:.0f} | {peak / (held + act):.2f} |", flush=True)


if __name__ == "__main__":
    main()
