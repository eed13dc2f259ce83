"""Fine-tuning side by side: edgerun vs PyTorch CPU on the same random-weight checkpoints, images and targets.

Usage (from the repo root, after `cargo build --release`; nothing else running):
    .venv/bin/python tools/bench/finetune.py                       # every row
    .venv/bin/python tools/bench/finetune.py --rows da2s:head da2s:last:2 --images 8 --epochs 3
    .venv/bin/python tools/bench/finetune.py --memory --images 4 --epochs 1   # checkpointing / offload (DA-V2-S)
Rows (model:train): DA-V2-Small 518² (`da2s`, task depth, L1) head / last:2 / all; SegFormer-B0 512² (`segformer`,
150 classes, cross-entropy as transformers computes it) all; CHMv2 ViT-L/16 416² (`chmv2`, task chm, L1) head /
last:2. Both sides: AdamW (lr 1e-4, wd 0.01), batch 2, no accumulation, EMA, validation, augmentation or clipping;
the same images in the same order. `head` trains the DPT neck + head (PyTorch runs the backbone under no_grad),
`last:2` adds the last two backbone blocks and the backbone's final norm, `all` every parameter. The trainable
parameter count is printed for both sides and must agree.
Printed per row: steps/s (median step time, the first step left out; edgerun's own figure over the steps after the
first), peak RSS of the whole process (PyTorch: a fresh interpreter per row; edgerun: /usr/bin/time), and the
paired ratio edgerun / PyTorch. edgerun's `head` rows run without the frozen-feature cache (as PyTorch, which
recomputes the backbone every step); `--cache` adds a row with it.
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

SIZES = {"da2s": 518, "segformer": 512, "chmv2": 416}
TASKS = {"da2s": "depth", "segformer": "segmentation", "chmv2": "chm"}
DEFAULT_ROWS = ["da2s:head", "da2s:last:2", "da2s:all", "segformer:all", "chmv2:head", "chmv2:last:2"]
BLOCK = re.compile(r"^backbone\.(?:encoder\.|model\.)?layer\.(\d+)\.")
FINAL_NORM = ("backbone.layernorm.", "backbone.norm.")


def build(model: str):
    if model == "da2s":
        from depth_anything import da2_small_config
        from transformers import DepthAnythingForDepthEstimation
        return DepthAnythingForDepthEstimation(da2_small_config())
    if model == "segformer":
        from transformers import SegformerConfig, SegformerForSemanticSegmentation
        cfg = SegformerConfig(num_labels=150, hidden_sizes=[32, 64, 160, 256], depths=[2, 2, 2, 2], decoder_hidden_size=256)
        return SegformerForSemanticSegmentation(cfg)
    from transformers import CHMv2Config, CHMv2ForDepthEstimation
    return CHMv2ForDepthEstimation(CHMv2Config())


def load(model: str, path: str):
    from transformers import CHMv2ForDepthEstimation, DepthAnythingForDepthEstimation, SegformerForSemanticSegmentation
    cls = {"da2s": DepthAnythingForDepthEstimation, "segformer": SegformerForSemanticSegmentation, "chmv2": CHMv2ForDepthEstimation}[model]
    return cls.from_pretrained(path)


def prepare(workdir: str, model: str, n: int) -> str:
    """The model's folder (checkpoint + data), made once per model and image count."""
    root = f"{workdir}/{model}"
    if not os.path.exists(f"{root}/model/config.json"):
        torch.manual_seed(0)
        build(model).save_pretrained(f"{root}/model")
    size = SIZES[model]
    data = f"{root}/data_{n}"
    if not os.path.isdir(data):
        rng = np.random.default_rng(0)
        os.makedirs(f"{data}/images")
        os.makedirs(f"{data}/targets")
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(f"{data}/images/img_{i:02d}.png")
            if model == "segformer":
                Image.fromarray(rng.integers(0, 150, (size, size), dtype=np.uint8)).save(f"{data}/targets/img_{i:02d}.png")
            else:
                hi = 2.0 if model == "da2s" else 30.0
                np.save(f"{data}/targets/img_{i:02d}.npy", rng.uniform(0.5, hi, (size, size)).astype(np.float32))
    return root


def trainable(names: list, mode: str) -> set:
    """edgerun's selection: head = everything outside the backbone, last:N adds the last N blocks and the final norm."""
    if mode == "all":
        return set(names)
    chosen = {n for n in names if not n.startswith("backbone.")}
    if mode.startswith("last:"):
        blocks = sorted({int(m.group(1)) for n in names if (m := BLOCK.match(n))})
        keep = set(blocks[-int(mode.split(":")[1]):])
        chosen |= {n for n in names if (m := BLOCK.match(n)) and int(m.group(1)) in keep}
        chosen |= {n for n in names if n.startswith(FINAL_NORM)}
    return chosen


def torch_run(root: str, model_name: str, mode: str, epochs: int, batch: int, n: int) -> None:
    """Runs in a child interpreter so that its peak RSS is its own."""
    torch.set_num_threads(threads())
    model = load(model_name, f"{root}/model").train()
    chosen = trainable([n for n, _ in model.named_parameters()], mode)
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(name in chosen)
        if name in chosen:
            params.append(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    data = f"{root}/data_{n}"
    names = sorted(os.listdir(f"{data}/images"))
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    xs = [((torch.from_numpy(np.array(Image.open(f"{data}/images/{f}"))).permute(2, 0, 1).float() / 255) - mean) / std for f in names]
    if model_name == "segformer":
        ys = [torch.from_numpy(np.array(Image.open(f"{data}/targets/{f}"))).long() for f in names]
    else:
        ys = [torch.from_numpy(np.load(f"{data}/targets/{f[:-4]}.npy")) for f in names]
    frozen_backbone = mode == "head"

    def predict(x):
        p = model.config.patch_size if model_name != "segformer" else 1
        ph, pw = x.shape[-2] // p, x.shape[-1] // p
        if model_name == "da2s" and frozen_backbone:
            with torch.no_grad():
                hidden = model.backbone.forward_with_filtered_kwargs(x, output_hidden_states=None, output_attentions=None).feature_maps
            return model.head(model.neck(hidden, ph, pw), ph, pw)
        if model_name == "chmv2" and frozen_backbone:
            with torch.no_grad():
                out = model.backbone(x)
            features = list(zip(out.feature_maps, out.cls_tokens))
            return model.features_to_depth(model.head(features, ph, pw)).squeeze(1)
        return model(pixel_values=x).predicted_depth

    times = []
    for _ in range(epochs):
        for s in range(0, len(xs), batch):
            t0 = time.perf_counter()
            x, y = torch.stack(xs[s:s + batch]), torch.stack(ys[s:s + batch])
            loss = model(pixel_values=x, labels=y).loss if model_name == "segformer" else (predict(x) - y).abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    import resource
    print(json.dumps({"step_s": median(times[1:]), "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "trainable": sum(p.numel() for p in params)}))


def edgerun_run(binary: str, root: str, model: str, mode: str, epochs: int, batch: int, n: int, cache: bool, extra: str = "") -> dict:
    tag = f"{mode.replace(':', '')}_{int(cache)}_{extra.replace(' ', '').replace('=', '')[:40]}"
    cfg, out, size = f"{root}/ft_{tag}.toml", f"{root}/out_{tag}", SIZES[model]
    subprocess.run(["rm", "-rf", out], check=True)
    loss = "" if model == "segformer" else 'loss = "l1"\n'
    with open(cfg, "w") as f:
        f.write(f'model = "{root}/model"\ntask = "{TASKS[model]}"\ndata = "{root}/data_{n}"\nout = "{out}"\n'
                f"input_size = [{size}, {size}]\nepochs = {epochs}\nbatch = {batch}\ntrain = \"{mode}\"\n{loss}"
                f"max_lr = 1e-4\npct_start = 0.3\nema_decay = 0.0\nval_fraction = 0.0\nclip_grad_norm = 0.0\n"
                f"save_every = 100000\nval_every = 100000\nfeature_cache_mib = {4096 if cache else 0}\n{extra}\n")
    r = subprocess.run(["/usr/bin/time", "-v", binary, "--threads", str(threads()), "finetune", "--config", cfg],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"edgerun failed on {model}:{mode}:\n{r.stdout}\n{r.stderr}")
    rate = float(re.search(r"\(([0-9.]+) steps/s\)", r.stdout).group(1))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) / 1024
    values = re.search(r"trainable tensors \((\d+) values\)", r.stdout + r.stderr)
    return {"steps_per_s": rate, "rss_mib": rss, "trainable": int(values.group(1)) if values else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="model:train, models " + ", ".join(SIZES))
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--cache", action="store_true", help="also run edgerun's head rows with the frozen-feature cache")
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/finetune")
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--torch-child", default=None)
    ap.add_argument("--memory", action="store_true",
                    help="instead: DA-V2-S last:4 plain vs --checkpoint-activations vs --offload (peak RSS)")
    a = ap.parse_args()
    if a.torch_child:
        model, mode = a.torch_child.split(":", 1)
        torch_run(f"{a.workdir}/{model}", model, mode, a.epochs, a.batch, a.images)
        return
    os.makedirs(a.workdir, exist_ok=True)
    print(f"threads={threads()} images={a.images} epochs={a.epochs} batch={a.batch}")
    if a.memory:
        root = prepare(a.workdir, "da2s", a.images)
        print("last:4   variant                    steps/s  peak RSS MiB")
        for label, extra in [("plain", ""), ("checkpointed", "checkpoint_activations = true"), ("offloaded", "offload = true")]:
            e = edgerun_run(a.binary, root, "da2s", "last:4", a.epochs, a.batch, a.images, False, extra)
            print(f"last:4   {label:26} {e['steps_per_s']:7.3f}  {e['rss_mib']:8.0f}")
        return
    print(f"{'row':18} {'side':24} {'steps/s':>8} {'peak RSS MiB':>13} {'trainable':>10}   ratios (steps/s, RSS)")
    for row in a.rows:
        model, mode = row.split(":", 1)
        root = prepare(a.workdir, model, a.images)
        r = subprocess.run([sys.executable, __file__, "--torch-child", row, "--workdir", a.workdir, "--epochs", str(a.epochs),
                            "--batch", str(a.batch), "--images", str(a.images)], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"PyTorch failed on {row}:\n{r.stderr[-3000:]}")
        t = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{row:18} {'PyTorch':24} {1 / t['step_s']:8.3f} {t['rss_mib']:13.0f} {t['trainable']:10d}", flush=True)
        for cache in ([False, True] if mode == "head" and a.cache else [False]):
            e = edgerun_run(a.binary, root, model, mode, a.epochs, a.batch, a.images, cache)
            label = "edgerun" + (" (feature cache)" if cache else "")
            print(f"{row:18} {label:24} {e['steps_per_s']:8.3f} {e['rss_mib']:13.0f} {e['trainable'] or 0:10d}   "
                  f"{e['steps_per_s'] * t['step_s']:.2f}x  {e['rss_mib'] / t['rss_mib']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
