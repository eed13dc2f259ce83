"""Side-by-side benchmark of the DA3-Small depth path (random weights at the real config): edgerun vs the package.

Usage (from the repo root, after `cargo build --release`):
    /work/venv/bin/python tools/bench/da3.py --size 504x504 --repeat 2
It builds `DepthAnything3Net` from the package's configs/da3-small.yaml, re-initialises it (tools/fixtures/common.py
reinit, so activations stay O(1)), writes it as the hub files are (config.json {"model_name": "da3-small"},
model.safetensors with the `model.` prefix) to --workdir (default /tmp/edgerun-bench/da3s), then times
* edgerun: `edgerun forward --repeat N` (depth + depth_conf; ray branch and camera decoder skipped), peak RSS;
* the package: DepthAnything3Net.forward in float32 (what the package runs: backbone, DualDPT with its ray branch,
  camera decoder) and its depth path alone (backbone + head, ray branch included since DualDPT always computes it).
"""
import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
from common import median, run_edgerun, threads  # noqa: E402


def build(seed: int):
    from depth_anything_3.cfg import create_object, load_config
    from depth_anything_3.registry import MODEL_REGISTRY
    import importlib.util

    spec = importlib.util.spec_from_file_location("fixture_common", os.path.join(os.path.dirname(__file__), "..", "fixtures", "common.py"))
    fc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fc)
    torch.manual_seed(seed)
    net = create_object(load_config(MODEL_REGISTRY["da3-small"])).eval()
    fc.reinit(net, seed)
    return net


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="504x504")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/da3s")
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--skip-edgerun", action="store_true")
    a = ap.parse_args()
    h, w = map(int, a.size.split("x"))
    net = build(0)
    torch.set_num_threads(threads())  # after build: the fixture helpers pin one thread on import
    os.makedirs(a.workdir, exist_ok=True)
    save_file({f"model.{k}": v.contiguous().clone() for k, v in net.state_dict().items()}, os.path.join(a.workdir, "model.safetensors"))
    with open(os.path.join(a.workdir, "config.json"), "w") as f:
        json.dump({"model_name": "da3-small"}, f)
    x = torch.randn(1, 1, 3, h, w, generator=torch.Generator().manual_seed(1))
    inp = os.path.join(a.workdir, f"input_{h}x{w}.safetensors")
    save_file({"pixel_values": x}, inp)
    n_params = sum(p.numel() for p in net.parameters())
    print(f"threads={torch.get_num_threads()} params={n_params} size={h}x{w}")

    def time_fn(fn):
        with torch.no_grad():
            fn()
            ts = []
            for _ in range(a.repeat):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
        return ts

    def depth_path():
        feats, _ = net.backbone(x, cam_token=None, export_feat_layers=[])
        return net._process_depth_head(feats, h, w)

    full = time_fn(lambda: net(x))
    dp = time_fn(depth_path)
    with torch.no_grad():
        ref = depth_path()
    save_file({"depth": ref["depth"].contiguous(), "depth_conf": ref["depth_conf"].contiguous()}, os.path.join(a.workdir, f"torch_out_{h}x{w}.safetensors"))
    print(f"torch DepthAnything3Net.forward  ms: {[round(t) for t in full]} (median {median(full):.0f})")
    print(f"torch backbone + DualDPT head    ms: {[round(t) for t in dp]} (median {median(dp):.0f})")
    if not a.skip_edgerun:
        ours, rss = run_edgerun(a.binary, a.workdir, inp, a.repeat)
        print(f"edgerun forward (depth path)     ms: {[round(t) for t in ours]} (median {median(ours):.0f}), peak RSS {rss:.0f} MiB")
        print(f"edgerun / torch depth path: {median(ours) / median(dp):.2f}")
        from safetensors.torch import load_file

        got = load_file(inp + ".edgerun-out.safetensors")
        for k in ("depth", "depth_conf"):
            err = float((got[k] - ref[k]).abs().max())
            print(f"edgerun vs torch {k}: max abs error {err:.3e} (max|ref| {float(ref[k].abs().max()):.3g})")


if __name__ == "__main__":
    main()
