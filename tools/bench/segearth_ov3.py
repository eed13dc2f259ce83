"""SegEarth-OV-3 side by side: the official segmentor (its logic as tools/fixtures/segearth_ov3.py copies it, on the
`sam3` package, PyTorch on the CPU) against `edgerun segment`, on the full-size random-weight SAM 3 that
compare.py's `sam3` row saves (hub layout, CLIP's BPE in tokenizer.json), one image of 1008² (one view, no
sliding window), OpenEarthMap's 9 classes (14 prompts) with its thresholds.

Per image the official code encodes each prompt's text and grounds the prompts one at a time; edgerun
computes the prompts' features once per run (or reads them from a GGUF made by `edgerun quantize --prompts`)
and grounds them in batches, decoding masks only for the queries it keeps. Timed: the official `predict`
of one image; edgerun's per-image time as it reports it (`segment: 1 done … N s`: decode, model, writing;
the model's load and the prompts' features excluded, as they are once per run). Agreement: the share of
pixels with the official class, and the largest score difference (edgerun's scores are float16).

Usage (a quiet machine; after `cargo build --release` and compare.py's sam3 row has saved the model):
    .venv/bin/python tools/bench/segearth_ov3.py --workdir /tmp/edgerun-bench/compare/sam3 \
        --variants f32 q8_0+prompts --results /tmp/segearth-results.md
"""
import argparse
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
# tools/bench/sam3.py would shadow the `sam3` package this script runs.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
OPENEARTHMAP = "background\nbareland,barren\ngrass\npavement\nroad\ntree,forest\nwater,river\ncropland\nbuilding,roof,house"
CONF, PROB_THD = 0.1, 0.1


def fixture_module(name):
    """A script of tools/fixtures by path (its `common` import is the fixtures' own)."""
    bench_common = sys.modules.pop("common", None)
    sys.path.insert(0, os.path.join(ROOT, "tools", "fixtures"))
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", "fixtures", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.pop(0)
        if bench_common is not None:
            sys.modules["common"] = bench_common


class CpuFactories:
    """Maps `device="cuda"` to the CPU in torch's factories while the package builds its model (its position
    and box-bias caches are made on "cuda" unconditionally)."""

    NAMES = ("zeros", "ones", "arange", "empty", "full", "tensor", "linspace")

    def __enter__(self):
        self.saved = {n: getattr(torch, n) for n in self.NAMES}
        for n, f in self.saved.items():
            setattr(torch, n, self.wrap(f))

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch, n, f)

    @staticmethod
    def wrap(f):
        def cpu(*a, **kw):
            if str(kw.get("device", "")).startswith("cuda"):
                kw["device"] = "cpu"
            return f(*a, **kw)

        return cpu


def original_model(workdir, seg_mod, tiny_mod):
    """The `sam3` package's image model at full size, its weights copied from the saved hub checkpoint, its
    tokenizer the checkpoint's tokenizer.json (the package's BPE asset is not shipped)."""
    import sam3.model_builder as builder
    from transformers import Sam3Model

    tok = seg_mod.JsonTokenizer(os.path.join(workdir, "tokenizer.json"))
    builder.SimpleTokenizer = lambda bpe_path=None: tok
    tiny_mod.cpu_only_sam3()
    with CpuFactories():
        orig = builder.build_sam3_image_model(device="cpu", eval_mode=True, checkpoint_path=None, load_from_HF=False)
    hf = Sam3Model.from_pretrained(workdir).eval()
    tiny_mod.copy_hf_to_original(hf, orig)
    del hf
    return orig


def edgerun_run(binary, model, image, out, extra):
    """`edgerun segment` on one image: (seconds per image as reported, peak RSS MiB, class map, scores)."""
    cmd = ["/usr/bin/time", "-v", binary, "segment", "--model", model, "--device", "cpu", "--preset", "openearthmap", "--slide", "0",
           "--scores", "--progress", "none", image, "--out", out, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"edgerun failed:\n{p.stderr}")
    secs = float(re.search(r"segment: 1 done, 0 failed, ([0-9.]+) s", p.stderr).group(1))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1)) / 1024
    from PIL import Image

    stem = os.path.splitext(os.path.basename(image))[0]
    classes = np.asarray(Image.open(os.path.join(out, f"{stem}.seg.png")))
    scores = np.load(os.path.join(out, f"{stem}.scores.npy")).astype(np.float32)
    return secs, rss, classes, scores


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/compare/sam3")
    ap.add_argument("--edgerun", default=os.path.join(ROOT, "target", "release", "edgerun"))
    ap.add_argument("--variants", nargs="+", default=["f32", "q8_0+prompts"])
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", str(os.cpu_count() or 1))))
    work = os.path.join(args.workdir, "segearth")
    os.makedirs(work, exist_ok=True)
    from PIL import Image

    image = os.path.join(work, "view.png")
    Image.open(os.path.join(ROOT, "examples", "images", "scene_1.jpg")).convert("RGB").resize((1008, 1008), Image.BICUBIC).save(image)
    prompts = os.path.join(work, "openearthmap.txt")
    with open(prompts, "w") as f:
        f.write(OPENEARTHMAP)

    models = {"f32": args.workdir}
    if "q8_0+prompts" in args.variants:
        gguf = os.path.join(work, "model-q8_0-oem.gguf")
        if not os.path.exists(gguf):
            subprocess.run([args.edgerun, "quantize", "--type", "q8_0", "--prompts", prompts, "--quiet", args.workdir, gguf], check=True)
        models["q8_0+prompts"] = gguf
    if "q8_0" in args.variants:
        gguf = os.path.join(args.workdir, "model-q8_0.gguf")
        if not os.path.exists(gguf):
            subprocess.run([args.edgerun, "quantize", "--type", "q8_0", "--quiet", args.workdir, gguf], check=True)
        models["q8_0"] = gguf

    seg_mod = fixture_module("segearth_ov3")
    tiny_mod = fixture_module("sam3_tiny")
    orig = original_model(args.workdir, seg_mod, tiny_mod)
    seg = seg_mod.SegEarthOV3(orig, 1008, OPENEARTHMAP, PROB_THD, 0, 0, 0, CONF)
    t = time.perf_counter()
    ref_scores, ref_classes = seg.predict(image)
    torch_s = time.perf_counter() - t
    ref_scores, ref_classes = ref_scores.numpy(), ref_classes.numpy()
    print(f"official segmentor (PyTorch): {torch_s:.1f} s, {seg.kept} queries kept", flush=True)
    del orig, seg

    rows = []
    for v in args.variants:
        out = os.path.join(work, f"out-{v}")
        secs, rss, classes, scores = edgerun_run(args.edgerun, models[v], image, out, [])
        same = float((classes == ref_classes).mean())
        err = float(np.abs(scores - ref_scores).max())
        print(f"edgerun {v}: {secs:.1f} s ({secs / torch_s:.2f}x), peak RSS {rss:.0f} MiB, {same:.4%} pixels agree, max score diff {err:.1e}", flush=True)
        rows.append(f"| SegEarth-OV-3, 1008², 9 classes / 14 prompts | {v} | {torch_s * 1e3:.0f} | {secs * 1e3:.0f} | {secs / torch_s:.2f} | {rss:.0f} | {same:.4%} | {err:.1e} |")
    table = [
        "| row | variant | official segmentor, PyTorch ms | edgerun ms | edgerun / official | edgerun peak RSS MiB | pixels agreeing | max score diff |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    about = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    text = "\n".join([f"Written by `tools/bench/segearth_ov3.py` on {time.strftime('%Y-%m-%d')} ({' '.join(sys.argv[1:])}); {about}.", "", *table, ""])
    print(text)
    if args.results:
        with open(args.results, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
