"""Shared helpers for side-by-side benchmarks: edgerun vs PyTorch vs ONNX Runtime on the same weights."""
import datetime
import json
import os
import resource
import subprocess
import time

import numpy as np
import torch


def time_torch(model, inputs: dict, repeat: int) -> list[float]:
    """Forward-pass wall times in ms (after one warm-up run)."""
    with torch.no_grad():
        model(**inputs)
        out = []
        for _ in range(repeat):
            t = time.perf_counter()
            model(**inputs)
            out.append((time.perf_counter() - t) * 1e3)
    return out


def time_onnx(model, inputs: dict, path: str, output_names: list[str], repeat: int):
    """Exports `model` to ONNX at `path` and returns ORT forward times in ms, or None if export fails."""
    if not export_onnx(model, inputs, path, output_names):
        return None
    return time_onnx_session(path, inputs, repeat)


def export_onnx(model, inputs: dict, path: str, output_names: list[str]) -> bool:
    """Exports `model` to ONNX at `path`; False (with the reason printed) if the exporter fails."""
    names = list(inputs)
    try:
        torch.onnx.export(model, tuple(inputs[n] for n in names), path, input_names=names,
                          output_names=output_names, opset_version=17, dynamo=False)
    except Exception as e:  # noqa: BLE001 - report and carry on without ORT
        print(f"onnx export failed: {e}")
        return False
    return True


def time_onnx_session(path: str, inputs: dict, repeat: int) -> list[float]:
    """ORT forward times in ms of the model at `path` (after one warm-up run), torch's thread count."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    feed = {n: t.numpy() for n, t in inputs.items()}
    sess.run(None, feed)
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        sess.run(None, feed)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def run_edgerun(binary: str, model_dir: str, input_path: str, repeat: int, dtype: str = "f32") -> tuple[list[float], float]:
    """Runs `edgerun forward --repeat` and returns (forward ms list, peak RSS MiB)."""
    out_path = input_path + ".edgerun-out.safetensors"
    cmd = ["/usr/bin/time", "-f", "%M", binary, "forward", "--model", model_dir, "--input", input_path,
           "--output", out_path, "--device", "cpu", "--dtype", dtype, "--repeat", str(repeat)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    timing = json.loads(next(l for l in lines if l.startswith("{")))
    rss_kb = int(lines[-1])
    return timing["forward_ms"], rss_kb / 1024


def median(xs):
    return float(np.median(xs)) if xs else float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def threads() -> int:
    return int(os.environ.get("BENCH_THREADS", str(os.cpu_count() or 1)))


def write_table(path: str, title: str, script: str, about: str, rounds: int, repeat: int, error: str,
                columns: list[str], rows: list[str]) -> None:
    """Writes a results file: the heading, how it was made (this run's arguments, `about` the machine),
    the timing and error conventions, and the Markdown table of `columns` and `rows`."""
    import sys

    head = [
        f"# {title}",
        "",
        f"Written by `tools/bench/{script}` on {datetime.date.today()} ({' '.join(sys.argv[1:]) or 'defaults'}).",
        about,
        f"Medians over {rounds} rounds × {repeat} forward passes per engine, engines alternating; load excluded.",
        error,
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    with open(path, "w") as f:
        f.write("\n".join(head + rows) + "\n")
    print(f"wrote {path}")
