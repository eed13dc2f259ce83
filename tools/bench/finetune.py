"""Fine-tuning DA-V2-Small (random weights at the real config) at 518×518: edgerun vs PyTorch CPU.

Usage (from the repo root, after `cargo build --release`; nothing else running):
    /work/venv/bin/python tools/bench/finetune.py [--images 8] [--epochs 3] [--batch 2]
    /work/venv/bin/python tools/bench/finetune.py --memory --images 4 --epochs 1   # checkpointing / offload
Both sides train the same checkpoint on the same images and targets in the same order settings: AdamW
(lr 1e-4, wd 0.01), masked L1 loss, batch 2, no accumulation, no EMA, no validation, no augmentation;
`head` trains the DPT neck + head (backbone frozen, run under no_grad in PyTorch), `last:2` adds the last two
backbone blocks and the final norm. Printed per mode: steps/s (median step time, the first step left out),
and peak RSS of the whole process (PyTorch: a fresh interpreter per mode; edgerun: /usr/bin/time). edgerun
runs twice for `head`: with its frozen-feature cache (default) and with `feature_cache_mib = 0`.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
from common import median, threads  # noqa: E402
from depth_anything import da2_small_config  # noqa: E402


def make_data(workdir: str, n: int, size: int) -> None:
    rng = np.random.default_rng(0)
    os.makedirs(f"{workdir}/data/images", exist_ok=True)
    os.makedirs(f"{workdir}/data/targets", exist_ok=True)
    for i in range(n):
        img = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
        Image.fromarray(img).save(f"{workdir}/data/images/img_{i:02d}.png")
        np.save(f"{workdir}/data/targets/img_{i:02d}.npy", rng.uniform(0.5, 2.0, (size, size)).astype(np.float32))


def torch_run(workdir: str, mode: str, epochs: int, batch: int, size: int) -> None:
    """Runs in a child interpreter so that its peak RSS is its own."""
    from transformers import DepthAnythingForDepthEstimation
    torch.set_num_threads(threads())
    model = DepthAnythingForDepthEstimation.from_pretrained(f"{workdir}/model").train()
    for p in model.parameters():
        p.requires_grad_(False)
    blocks = model.backbone.encoder.layer
    train = list(model.neck.parameters()) + list(model.head.parameters())
    if mode == "last:2":
        for m in list(blocks[-2:]) + [model.backbone.layernorm]:
            train += list(m.parameters())
    for p in train:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(train, lr=1e-4, weight_decay=0.01)
    names = sorted(os.listdir(f"{workdir}/data/images"))
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    xs = [((torch.from_numpy(np.array(Image.open(f"{workdir}/data/images/{n}"))).permute(2, 0, 1).float() / 255) - mean) / std for n in names]
    ys = [torch.from_numpy(np.load(f"{workdir}/data/targets/{n[:-4]}.npy")) for n in names]
    times = []
    for _ in range(epochs):
        for s in range(0, len(xs), batch):
            t0 = time.perf_counter()
            x, y = torch.stack(xs[s:s + batch]), torch.stack(ys[s:s + batch])
            if mode == "head":
                with torch.no_grad():
                    out = model.backbone.forward_with_filtered_kwargs(x, output_hidden_states=None, output_attentions=None)
                hidden = out.feature_maps
                ph, pw = size // 14, size // 14
                pred = model.head(model.neck(hidden, ph, pw), ph, pw)
            else:
                pred = model(pixel_values=x).predicted_depth
            loss = (pred - y).abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    import resource
    print(json.dumps({"step_s": median(times[1:]), "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def edgerun_run(binary: str, workdir: str, mode: str, epochs: int, batch: int, size: int, cache: bool,
                extra: str = "") -> dict:
    tag = f"{mode.replace(':', '')}_{int(cache)}_{extra.replace(' ', '').replace('=', '')[:40]}"
    cfg = f"{workdir}/ft_{tag}.toml"
    out = f"{workdir}/out_{tag}"
    subprocess.run(["rm", "-rf", out], check=True)
    with open(cfg, "w") as f:
        f.write(f'model = "{workdir}/model"\ntask = "depth"\ndata = "{workdir}/data"\nout = "{out}"\n'
                f"input_size = [{size}, {size}]\nepochs = {epochs}\nbatch = {batch}\ntrain = \"{mode}\"\nloss = \"l1\"\n"
                f"max_lr = 1e-4\npct_start = 0.3\nema_decay = 0.0\nval_fraction = 0.0\nclip_grad_norm = 0.0\n"
                f"save_every = 100000\nval_every = 100000\nfeature_cache_mib = {4096 if cache else 0}\n{extra}\n")
    r = subprocess.run(["/usr/bin/time", "-v", binary, "--threads", str(threads()), "finetune", "--config", cfg],
                       capture_output=True, text=True, check=True)
    rate = float(re.search(r"\(([0-9.]+) steps/s\)", r.stdout).group(1))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) / 1024
    return {"steps_per_s": rate, "rss_mib": rss}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--size", type=int, default=518)
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/finetune")
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--torch-child", default=None)
    ap.add_argument("--memory", action="store_true",
                    help="instead: edgerun last:4 plain vs --checkpoint-activations vs --offload (peak RSS)")
    a = ap.parse_args()
    if a.torch_child:
        torch_run(a.workdir, a.torch_child, a.epochs, a.batch, a.size)
        return
    from transformers import DepthAnythingForDepthEstimation
    torch.manual_seed(0)
    os.makedirs(a.workdir, exist_ok=True)
    DepthAnythingForDepthEstimation(da2_small_config()).save_pretrained(f"{a.workdir}/model")
    make_data(a.workdir, a.images, a.size)
    print(f"threads={threads()} images={a.images} epochs={a.epochs} batch={a.batch} size={a.size}")
    if a.memory:
        print("last:4   variant                    steps/s  peak RSS MiB")
        for label, extra in [("plain", ""), ("checkpointed", "checkpoint_activations = true"), ("offloaded", "offload = true")]:
            e = edgerun_run(a.binary, a.workdir, "last:4", a.epochs, a.batch, a.size, False, extra)
            print(f"last:4   {label:26} {e['steps_per_s']:7.3f}  {e['rss_mib']:8.0f}")
        return
    print("mode     side                       steps/s  peak RSS MiB")
    for mode in ["head", "last:2"]:
        r = subprocess.run([sys.executable, __file__, "--torch-child", mode, "--workdir", a.workdir, "--epochs", str(a.epochs),
                            "--batch", str(a.batch), "--size", str(a.size)], capture_output=True, text=True, check=True)
        t = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{mode:8} PyTorch                    {1 / t['step_s']:7.3f}  {t['rss_mib']:8.0f}")
        for cache in ([True, False] if mode == "head" else [False]):
            e = edgerun_run(a.binary, a.workdir, mode, a.epochs, a.batch, a.size, cache)
            label = "edgerun" + (" (feature cache)" if cache else " (no cache)" if mode == "head" else "")
            print(f"{mode:8} {label:26} {e['steps_per_s']:7.3f}  {e['rss_mib']:8.0f}   ratio {e['steps_per_s'] * t['step_s']:.2f}x")


if __name__ == "__main__":
    main()
