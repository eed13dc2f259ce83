"""Side-by-side benchmark of DA-V2-Small (random weights at the real config): edgerun vs PyTorch vs ORT.

Usage (from the repo root, after `cargo build --release`):
    /work/venv/bin/python tools/bench/depth_anything.py --sizes 518x518 518x686 --batch 1 4 --repeat 3
It writes the random-weight checkpoint to --workdir (default /tmp/edgerun-bench/da2s) and prints one
table row per (size, batch) with median times and the ratios edgerun/PyTorch and edgerun/ORT.
"""
import argparse
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation, Dinov2Config

sys.path.insert(0, os.path.dirname(__file__))
from common import median, run_edgerun, threads, time_onnx, time_torch  # noqa: E402


def da2_small_config() -> DepthAnythingConfig:
    backbone = Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4, patch_size=14,
                            image_size=518, layer_norm_eps=1e-6, out_indices=[3, 6, 9, 12], apply_layernorm=True,
                            reshape_hidden_states=False)
    return DepthAnythingConfig(backbone_config=backbone, reassemble_hidden_size=384, patch_size=14,
                               neck_hidden_sizes=[48, 96, 192, 384], reassemble_factors=[4, 2, 1, 0.5],
                               fusion_hidden_size=64, head_hidden_size=32, depth_estimation_type="relative")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["518x518", "518x686"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/da2s")
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--dtypes", nargs="+", default=["f32"])
    ap.add_argument("--no-onnx", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(threads())
    torch.manual_seed(0)
    model = DepthAnythingForDepthEstimation(da2_small_config()).eval()
    os.makedirs(a.workdir, exist_ok=True)
    model.save_pretrained(a.workdir)
    print(f"threads={torch.get_num_threads()} params={sum(p.numel() for p in model.parameters())}")
    print("size     batch dtype  torch_ms  ort_ms  edgerun_ms  rss_MiB  edgerun/torch  edgerun/ort")
    for size in a.sizes:
        h, w = map(int, size.split("x"))
        for b in a.batch:
            x = torch.randn(b, 3, h, w)
            inp = os.path.join(a.workdir, f"input_{h}x{w}_b{b}.safetensors")
            save_file({"pixel_values": x}, inp)
            t_torch = median(time_torch(model, {"pixel_values": x}, a.repeat))
            t_ort = None
            if not a.no_onnx:
                r = time_onnx(model, {"pixel_values": x}, os.path.join(a.workdir, f"m_{h}x{w}_b{b}.onnx"), ["predicted_depth"], a.repeat)
                t_ort = median(r) if r else None
            for dt in a.dtypes:
                model_path = a.workdir if not dt.startswith("gguf:") else dt.split(":", 1)[1]
                ours, rss = run_edgerun(a.binary, model_path, inp, a.repeat, "f32" if dt.startswith("gguf:") else dt)
                t_ours = median(ours)
                ort_s = f"{t_ort:8.0f}" if t_ort else "     n/a"
                ratio_ort = f"{t_ours / t_ort:11.2f}" if t_ort else "        n/a"
                print(f"{size:8} {b:5} {dt[:6]:6} {t_torch:9.0f} {ort_s} {t_ours:11.0f} {rss:8.0f} {t_ours / t_torch:14.2f} {ratio_ort}", flush=True)


if __name__ == "__main__":
    main()
