"""Side-by-side benchmark of a full-size CHMv2 (DINOv3 ViT-L/16 + DPT head, random weights at the real config):
edgerun vs PyTorch on the same weights and input, plus edgerun's reduced-precision / quantized variants.

Usage (from the repo root, after `cargo build --release`):
    /work/venv/bin/python tools/bench/chmv2.py --size 416x416 --repeat 2 \
        --variants f32 f16 gguf:q4k gguf:q6k --torch-half
It writes the random-weight checkpoint (1.35 GB, not committed) and the GGUF copies to --workdir
(default /tmp/edgerun-bench/chmv2), times PyTorch (f32), runs `edgerun forward --repeat` under
/usr/bin/time for each variant, and prints per variant: median forward ms, peak RSS, and the max abs
error of predicted_depth (metres) against PyTorch f32. With --torch-half it also runs the reference in
bf16 / f16 (CPU) and reports whether it stays finite.
Weights: `--init reinit` (default) uses tools/fixtures/common.reinit (O(1) activations, every weight
matters); `--init hf` keeps transformers' own init (std 0.02, zero biases: near-constant outputs).
"""
import argparse
import os
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file, save_file
from transformers import CHMv2Config, CHMv2ForDepthEstimation

sys.path.insert(0, os.path.dirname(__file__))
from common import median, peak_rss_mib, threads, time_torch  # noqa: E402


def fixtures_reinit():
    """tools/fixtures/common.reinit (loaded by path: tools/bench/common.py shadows the module name)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "common.py")
    spec = importlib.util.spec_from_file_location("fixtures_common", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.reinit


def run_variant(binary, workdir, inp, variant, repeat):
    """(forward ms list, peak RSS MiB, output tensor) of one edgerun variant."""
    dtype, model = "f32", workdir
    if variant.startswith("gguf:"):
        q = variant.split(":", 1)[1]
        model = os.path.join(workdir, f"chmv2_{q}.gguf")
        if not os.path.exists(model):
            subprocess.run([binary, "quantize", workdir, model, "--type", q, "--quiet"], check=True)
    elif variant == "f16":
        dtype = "f16"
    elif variant != "f32":
        raise SystemExit(f"unknown variant {variant} (f32, f16, gguf:<type>)")
    out = inp + f".{variant.replace(':', '_')}.out.safetensors"
    cmd = ["/usr/bin/time", "-f", "%M", binary, "forward", "--model", model, "--input", inp, "--output", out,
           "--device", "cpu", "--dtype", dtype, "--repeat", str(repeat)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    import json
    timing = json.loads(next(l for l in lines if l.startswith("{")))
    return timing["forward_ms"], int(lines[-1]) / 1024, load_file(out)["predicted_depth"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="416x416")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/chmv2")
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--variants", nargs="+", default=["f32", "f16", "gguf:q4k", "gguf:q6k"])
    ap.add_argument("--init", choices=["reinit", "hf"], default="reinit")
    ap.add_argument("--torch-half", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(threads())
    torch.manual_seed(0)
    h, w = map(int, a.size.split("x"))
    os.makedirs(a.workdir, exist_ok=True)
    model = CHMv2ForDepthEstimation(CHMv2Config()).eval()
    if a.init == "reinit":
        fixtures_reinit()(model, 0)
        torch.set_num_threads(threads())  # fixtures/common.py pins torch to one thread on import
    if not os.path.exists(os.path.join(a.workdir, "model.safetensors")):
        model.save_pretrained(a.workdir)
    inp = os.path.join(a.workdir, f"input_{h}x{w}.safetensors")
    x = torch.randn(1, 3, h, w, generator=torch.Generator().manual_seed(1))
    save_file({"pixel_values": x}, inp)
    n = sum(p.numel() for p in model.parameters())
    print(f"threads={torch.get_num_threads()} params={n} size={h}x{w} init={a.init}")
    t_torch = time_torch(model, {"pixel_values": x}, a.repeat)
    with torch.no_grad():
        ref = model(pixel_values=x).predicted_depth
    print(f"pytorch f32: forward ms {[round(t) for t in t_torch]} (median {median(t_torch):.0f}), "
          f"process peak RSS {peak_rss_mib():.0f} MiB, depth range [{ref.min():.3f}, {ref.max():.3f}] m")
    if a.torch_half:
        for dt in (torch.bfloat16, torch.float16):
            m = CHMv2ForDepthEstimation(CHMv2Config()).eval()
            m.load_state_dict(model.state_dict())
            m = m.to(dt)
            t = time.perf_counter()
            with torch.no_grad():
                y = m(pixel_values=x.to(dt)).predicted_depth.float()
            bad = int((~torch.isfinite(y)).sum())
            err = float((y - ref).abs().nan_to_num(float("inf")).max())
            print(f"pytorch {dt}: {time.perf_counter() - t:.1f} s, non-finite {bad}/{y.numel()}, max abs err {err:.4f} m")
            del m
    print("variant       median_ms  forward_ms          peak_RSS_MiB  max_abs_err_m  edgerun/torch")
    for v in a.variants:
        ms, rss, y = run_variant(a.binary, a.workdir, inp, v, a.repeat)
        err = float((y.float() - ref).abs().nan_to_num(float("inf")).max())
        print(f"{v:12} {median(ms):10.0f}  {str([round(t) for t in ms]):18} {rss:13.0f}  {err:13.5f}  {median(ms) / median(t_torch):13.2f}",
              flush=True)


if __name__ == "__main__":
    main()
