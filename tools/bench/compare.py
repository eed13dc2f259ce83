"""One side-by-side run: PyTorch eager, ONNX Runtime and `edgerun forward` on the same random full-size
weights and input, for every model family, writing benches/RESULTS.md.

Usage (from the repo root, after `cargo build --release`; a quiet machine — nothing else running):
    /work/venv/bin/python tools/bench/compare.py                       # every row, every variant
    /work/venv/bin/python tools/bench/compare.py --rows da2s segformer --variants f32 q8_0 --rounds 3

Each row builds its model with random O(1) weights (tools/fixtures/common.reinit), saves it in the hub
layout under --workdir, exports ONNX (where the exporter can), and then runs the three engines in turn,
--rounds times (each round in an order rotated by one place, a second's pause before each engine), each round timing --repeat forward passes per engine after a warm-up (edgerun through
`edgerun forward --repeat N+1`, one process per round, load and its first pass excluded). Reported per row and variant: the
median forward time; edgerun/ORT, edgerun/PyTorch and (for f16 and the quantized types) the variant/f32,
each the median over rounds of that round's ratio of medians (paired: a slow phase of a shared host
falls on both sides of a ratio instead of on whichever engine it overlapped); achieved GFLOP/s (FLOPs counted by PyTorch's
FlopCounterMode on the reference forward), edgerun's peak RSS, and the max abs error of edgerun's output
against PyTorch f32 relative to max(1, max|ref|) — so that a fast wrong answer shows. Variants: f32,
and GGUF files made by `edgerun quantize --type <variant>`: f16 (weights held in f16, computed in f32
on the CPU), q8_0, q4k; for SAM 3 also `q8_0+prompts` (`edgerun quantize --prompts`: the prompts' text
features stored, the text encoder left out, the image alone as input). L-GATr is also timed under
`torch.compile`.

SegEarth-OV-3 (open-vocabulary segmentation: the whole segmentor on one image against the official one, not a
forward pass) is timed by tools/bench/segearth_ov3.py on the model that the `sam3` row saves under --workdir.
"""
import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import export_onnx, median, threads, time_onnx_session, time_torch, write_table  # noqa: E402


def fixtures_common():
    """tools/fixtures/common.py, loaded by path (tools/bench/common.py shadows the module name)."""
    spec = importlib.util.spec_from_file_location("fixtures_common", os.path.join(HERE, "..", "fixtures", "common.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Case:
    """One row: a reference callable, its inputs, the output names compared, and the saved model dir."""

    def __init__(self, name, label, forward, inputs, outputs, model_dir, onnx_module=None):
        self.name, self.label, self.forward, self.inputs = name, label, forward, inputs
        self.outputs, self.model_dir, self.onnx_module = outputs, model_dir, onnx_module
        # For a `+prompts` variant: the prompt file stored by quantize, and the inputs left once it is.
        self.prompt_file, self.image_inputs = None, None


def hub_case(name, label, model, workdir, size, output):
    """A transformers model re-initialised (O(1) activations), saved in the hub layout, on one
    random image of `size` (H, W)."""
    model = model.eval()
    fixtures_common().reinit(model, 0)
    model.save_pretrained(workdir)
    x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(1))
    fwd = lambda **kw: {output: getattr(model(**kw), output)}  # noqa: E731
    return Case(name, label, fwd, {"pixel_values": x}, [output], workdir, model)


def build_da2s(workdir):
    from depth_anything import da2_small_config
    from transformers import DepthAnythingForDepthEstimation

    model = DepthAnythingForDepthEstimation(da2_small_config())
    return hub_case("da2s", "DA-V2-Small @ 518²", model, workdir, (518, 518), "predicted_depth")


def build_segformer(workdir):
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    cfg = SegformerConfig(num_labels=150, hidden_sizes=[32, 64, 160, 256], depths=[2, 2, 2, 2], decoder_hidden_size=256)
    return hub_case("segformer", "SegFormer-B0 @ 512²", SegformerForSemanticSegmentation(cfg), workdir, (512, 512), "logits")


def build_chmv2(workdir):
    from transformers import CHMv2Config, CHMv2ForDepthEstimation

    model = CHMv2ForDepthEstimation(CHMv2Config())
    return hub_case("chmv2", "CHMv2 (ViT-L/16) @ 416²", model, workdir, (416, 416), "predicted_depth")


def build_da3s(workdir):
    from da3 import build

    net = build(0)
    save_file({f"model.{k}": v.contiguous().clone() for k, v in net.state_dict().items()}, os.path.join(workdir, "model.safetensors"))
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"model_name": "da3-small"}, f)
    x = torch.randn(1, 1, 3, 504, 504, generator=torch.Generator().manual_seed(1))

    def fwd(pixel_values):
        feats, _ = net.backbone(pixel_values, cam_token=None, export_feat_layers=[])
        out = net._process_depth_head(feats, 504, 504)
        return {"depth": out["depth"], "depth_conf": out["depth_conf"]}

    return Case("da3s", "DA3-Small depth path @ 504²", fwd, {"pixel_values": x}, ["depth", "depth_conf"], workdir)


def build_lgatr(workdir):
    # tools/bench/lgatr.py shadows the lgatr package while this directory is on the path.
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != HERE]
    sys.modules.pop("lgatr", None)
    try:
        from lgatr import LGATr
    finally:
        sys.path[:] = saved
    spec = importlib.util.spec_from_file_location("lgatr_bench", os.path.join(HERE, "lgatr.py"))
    lb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lb)
    torch.manual_seed(0)
    model = LGATr(**lb.CONFIG).eval()
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"model_type": "lgatr", **lb.CONFIG}, f, indent=2)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, os.path.join(workdir, "model.safetensors"))
    mv, s = lb.make_input(32, 200)

    def fwd(multivectors, scalars):
        out_mv, out_s = model(multivectors, scalars)
        return {"outputs_mv": out_mv, "outputs_s": out_s}

    case = Case("lgatr", "L-GATr top-tagging, 32 × 200", fwd, {"multivectors": mv, "scalars": s}, ["outputs_mv", "outputs_s"], workdir)
    case.compiled = torch.compile(model)
    return case


def build_sam3(workdir):
    import sam3 as sam3_bench

    fwd, inputs, outputs = sam3_bench.build(workdir, fixtures_common().reinit)
    case = Case("sam3", f"SAM 3 @ 1008², 1 image × {sam3_bench.PROMPTS} prompts", fwd, inputs, outputs, workdir)
    case.prompt_file, case.image_inputs = os.path.join(workdir, "prompts.txt"), ["pixel_values"]
    return case


BUILDERS = {"da2s": build_da2s, "segformer": build_segformer, "da3s": build_da3s, "chmv2": build_chmv2, "lgatr": build_lgatr, "sam3": build_sam3}


def reference(case):
    """The reference outputs and the FLOPs counted while computing them (one forward: SAM 3's takes minutes)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        ref = case.forward(**case.inputs)
    return ref, fc.get_total_flops()


def edgerun_model(binary, case, variant):
    """(model path, compute dtype) of a variant: the checkpoint for f32, else a GGUF copy made once by
    `edgerun quantize` (`TYPE+prompts`: with the case's prompt features stored)."""
    if variant == "f32":
        return case.model_dir, "f32"
    qtype, _, extra = variant.partition("+")
    path = os.path.join(case.model_dir, f"model-{qtype}{'-' + extra if extra else ''}.gguf")
    if not os.path.exists(path):
        cmd = [binary, "quantize", "--type", qtype, "--quiet", case.model_dir, path]
        subprocess.run(cmd + (["--prompts", case.prompt_file] if extra == "prompts" else []), check=True)
    return path, "f32"


def run_edgerun(binary, case, variant, input_path, repeat):
    """(forward ms list, peak RSS MiB, outputs) of one `edgerun forward --repeat` process; its first
    pass is the warm-up that PyTorch and ORT get too, not counted."""
    model, dtype = edgerun_model(binary, case, variant)
    if variant.endswith("+prompts"):
        input_path = input_path.replace(".safetensors", ".image.safetensors")
        save_file({k: case.inputs[k] for k in case.image_inputs}, input_path)
    out = input_path + f".{variant}.out.safetensors"
    cmd = ["/usr/bin/time", "-f", "%M", binary, "forward", "--model", model, "--input", input_path, "--output", out,
           "--device", "cpu", "--dtype", dtype, "--repeat", str(repeat + 1)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()[-400:]}")
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    timing = json.loads(next(line for line in lines if line.startswith("{")))
    return timing["forward_ms"][1:], int(lines[-1]) / 1024, load_file(out)


def rel_error(got, ref, names):
    worst = 0.0
    for n in names:
        r = ref[n].float()
        err = float((got[n].float().reshape(r.shape) - r).abs().nan_to_num(float("inf")).max())
        worst = max(worst, err / max(1.0, float(r.abs().max())))
    return worst


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            have = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
        flags = " (" + ", ".join(x for x in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if x in have) + ")"
    except (OSError, StopIteration):
        pass
    import onnxruntime

    return (f"{cpu}{flags}, {os.cpu_count()} logical cores, {threads()} threads for every engine; {platform.platform()}; "
            f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}")


# Seconds between one engine's passes and the next engine's (see main).
SETTLE_S = 1.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    ap.add_argument("--variants", nargs="+", default=["f32", "f16", "q8_0", "q4k"])
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the engines")
    ap.add_argument("--repeat", type=int, default=3, help="forward passes per engine per round")
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/compare")
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--results", default="benches/RESULTS.md")
    a = ap.parse_args()
    torch.manual_seed(0)
    lines = []
    for name in a.rows:
        workdir = os.path.join(a.workdir, name)
        os.makedirs(workdir, exist_ok=True)
        try:
            case = BUILDERS[name](workdir)
        except ImportError as e:  # a reference package missing: say so and go on with the other rows
            print(f"== {name}: skipped, {e} (see tools/requirements*.txt)", flush=True)
            lines.append(f"| {name} | skipped: {e} | | | | | | | | | |")
            continue
        torch.set_num_threads(threads())  # after the build: the fixture helpers pin one thread
        inp = os.path.join(workdir, "input.safetensors")
        save_file(case.inputs, inp)
        ref, flops = reference(case)
        onnx_path = os.path.join(workdir, "model.onnx")
        have_onnx = case.onnx_module is not None and export_onnx(case.onnx_module, case.inputs, onnx_path, case.outputs)
        times = {"torch": [], "ort": [], "compiled": []}
        ours = {v: [] for v in a.variants}
        rounds = []  # per round: {engine or variant: median ms}
        rss, err = {}, {}
        engines = ["torch"] + (["ort"] if have_onnx else []) + (["compiled"] if hasattr(case, "compiled") else [])
        for k in range(a.rounds):
            this_round = {}
            # Each round starts one place further along, so that no engine or variant always runs
            # right after the same other one.
            order = engines + list(a.variants)
            for item in order[k % len(order):] + order[:k % len(order)]:
                # PyTorch's OpenMP workers and ORT's pool spin on after their last pass: let them
                # settle so that they do not share the cores with the next engine's passes.
                time.sleep(SETTLE_S)
                if item == "torch":
                    ms = time_torch(case.forward, case.inputs, a.repeat)
                elif item == "ort":
                    ms = time_onnx_session(onnx_path, case.inputs, a.repeat)
                elif item == "compiled":
                    ms = time_torch(lambda **kw: case.compiled(*kw.values()), case.inputs, a.repeat)
                elif item.endswith("+prompts") and case.prompt_file is None:
                    continue  # a model without prompts
                else:
                    try:
                        ms, r, out = run_edgerun(a.binary, case, item, inp, a.repeat)
                    except RuntimeError as e:
                        print(f"{name} {item}: {e}")
                        continue
                    rss[item] = max(rss.get(item, 0), r)
                    err[item] = rel_error(out, ref, case.outputs)
                (times[item] if item in engines else ours[item]).extend(ms)
                this_round[item] = median(ms)
            rounds.append(this_round)

        def paired(num, den):
            """Median over rounds of num's median / den's median in the same round (None if never both)."""
            r = [x[num] / x[den] for x in rounds if num in x and den in x]
            return median(r) if r else None
        t_torch, t_ort, t_comp = median(times["torch"]), median(times["ort"]), median(times["compiled"])
        ref_s = f"PyTorch {t_torch:.0f} ms" + (f", ORT {t_ort:.0f} ms" if times["ort"] else ", ORT n/a") + (
            f", torch.compile {t_comp:.0f} ms" if times["compiled"] else "")
        print(f"== {case.label}: {flops / 1e9:.1f} GFLOP; {ref_s}", flush=True)
        torch_cell = f"{t_torch:.0f}" + (f" (compiled {t_comp:.0f})" if times["compiled"] else "")
        ort_cell = f"{t_ort:.0f}" if times["ort"] else "—"
        for v in a.variants:
            if not ours[v]:
                continue
            t = median(ours[v])
            vs_ort = f"{paired(v, 'ort'):.2f}" if times["ort"] else "—"
            vs_torch = f"{paired(v, 'torch'):.2f}" + (f" (compiled {paired(v, 'compiled'):.2f})" if times["compiled"] else "")
            vs_f32 = paired(v, "f32") if v != "f32" else None
            vs_f32 = f"{vs_f32:.2f}" if vs_f32 is not None else "—"
            row = (f"| {case.label} | {v} | {torch_cell} | {ort_cell} | {t:.0f} | {vs_ort} | {vs_torch} | {vs_f32} | "
                   f"{flops / t / 1e6:.0f} | {rss[v]:.0f} | {err[v]:.1e} |")
            print(row, flush=True)
            lines.append(row)
    write_results(a, lines)


def write_results(a, lines):
    write_table(a.results, "Side-by-side CPU results", "compare.py", f"Machine: {machine()}.", a.rounds, a.repeat,
                "Ratios: median over rounds of the ratio of the two medians in that round (paired). "
                "Error: max |edgerun − PyTorch f32| / max(1, max|PyTorch|) over the outputs.",
                ["model @ input", "edgerun", "PyTorch ms", "ORT ms", "edgerun ms", "edgerun / ORT", "edgerun / PyTorch",
                 "variant / f32", "edgerun GFLOP/s", "edgerun peak RSS MiB", "error"], lines)

if __name__ == "__main__":
    main()
