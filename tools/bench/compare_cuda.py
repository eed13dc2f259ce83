"""CUDA rows of the side-by-side comparison: PyTorch CUDA (f32 with TF32 off, and bf16) against
`edgerun forward --device cuda` (f32, f16, bf16 and a Q8_0 GGUF) on the same random full-size weights
and input, writing a Markdown table (default benches/RESULTS-cuda.md).

Usage, on a machine with an NVIDIA GPU, after a CUDA build (`cargo build --release --features cuda`):
    python3 tools/bench/compare_cuda.py --binary target/release/edgerun --rows da2s segformer chmv2

The hub rows of compare.py (DA-V2-Small, SegFormer-B0, CHMv2) are built the same way (random O(1)
weights, one random image); a row whose transformers class is missing is skipped and says so.
Times are medians of --repeat forward passes after a warm-up, each engine in --rounds alternations;
PyTorch's are between `torch.cuda.synchronize()` calls, edgerun's its own (`forward --repeat`
synchronises the device around each pass). Error: max |edgerun − PyTorch f32| / max(1, max|ref|).
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402
from common import median, write_table  # noqa: E402

HUB_ROWS = ("da2s", "segformer", "chmv2")


def time_cuda(module, inputs, output, repeat):
    """Forward times in ms on the GPU, after a warm-up, each pass between device synchronisations."""
    with torch.no_grad():
        module(**inputs)
        torch.cuda.synchronize()
        out = []
        for _ in range(repeat):
            t = time.perf_counter()
            getattr(module(**inputs), output)
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def run_edgerun(binary, model, dtype, input_path, repeat):
    """(forward ms list, outputs) of one `edgerun forward --device cuda` process; its first pass is
    the warm-up that PyTorch gets too, not counted."""
    out = input_path + f".cuda-{os.path.basename(model)}-{dtype}.safetensors"
    cmd = [binary, "forward", "--model", model, "--input", input_path, "--output", out, "--device", "cuda",
           "--dtype", dtype, "--repeat", str(repeat + 1)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()[-600:]}")
    line = next(x for x in p.stderr.splitlines() if x.startswith("{"))
    return json.loads(line)["forward_ms"][1:], load_file(out)


def row(a, name):
    workdir = os.path.join(a.workdir, name)
    os.makedirs(workdir, exist_ok=True)
    case = compare.BUILDERS[name](workdir)
    inp = os.path.join(workdir, "input.safetensors")
    save_file(case.inputs, inp)
    output = case.outputs[0]
    module = case.onnx_module.cuda()
    inputs = {k: v.cuda() for k, v in case.inputs.items()}
    with torch.no_grad():
        ref = {output: getattr(module(**inputs), output).float().cpu()}
    q8 = os.path.join(workdir, "model-q8_0.gguf")
    if not os.path.exists(q8):
        subprocess.run([a.binary, "quantize", "--type", "q8_0", "--quiet", workdir, q8], check=True)
    variants = {"f32": (workdir, "f32"), "f16": (workdir, "f16"), "bf16": (workdir, "bf16"), "q8_0": (q8, "f32")}
    t_f32, t_bf16 = [], []
    ours = {v: [] for v in variants}
    err = {}
    module_bf16 = copy.deepcopy(module).to(torch.bfloat16)
    inputs_bf16 = {k: v.to(torch.bfloat16) for k, v in inputs.items()}
    for _ in range(a.rounds):
        t_f32 += time_cuda(module, inputs, output, a.repeat)
        t_bf16 += time_cuda(module_bf16, inputs_bf16, output, a.repeat)
        for v, (model, dtype) in variants.items():
            try:
                ms, out = run_edgerun(a.binary, model, dtype, inp, a.repeat)
            except RuntimeError as e:
                print(f"{name} {v}: {e}", flush=True)
                continue
            ours[v] += ms
            err[v] = compare.rel_error(out, ref, [output])
    pt32, pt16 = median(t_f32), median(t_bf16)
    lines = []
    for v in variants:
        if not ours[v]:
            lines.append(f"| {case.label} | {v} | {pt32:.1f} | {pt16:.1f} | failed | | | |")
            continue
        t = median(ours[v])
        lines.append(f"| {case.label} | {v} | {pt32:.1f} | {pt16:.1f} | {t:.1f} | {t / pt32:.2f} | {t / pt16:.2f} | {err[v]:.1e} |")
        print(lines[-1], flush=True)
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=list(HUB_ROWS), choices=list(HUB_ROWS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/cuda")
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--results", default="benches/RESULTS-cuda.md")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    lines = []
    for name in a.rows:
        try:
            lines += row(a, name)
        except (ImportError, AttributeError) as e:  # a model class this transformers lacks
            print(f"== {name}: skipped, {e}", flush=True)
            lines.append(f"| {name} | skipped: {e} | | | | | | |")
    gpu = torch.cuda.get_device_name(0)
    write_table(a.results, "Side-by-side CUDA results", "compare_cuda.py",
                f"GPU: {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); TF32 off for PyTorch f32.",
                a.rounds, a.repeat, "Error: max |edgerun − PyTorch f32| / max(1, max|PyTorch f32|).",
                ["model @ input", "edgerun", "PyTorch f32 ms", "PyTorch bf16 ms", "edgerun ms", "edgerun / PyTorch f32",
                 "edgerun / PyTorch bf16", "error"], lines)

if __name__ == "__main__":
    main()
