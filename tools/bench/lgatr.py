"""PyTorch-CPU side of the L-GATr benchmark (issue 7).

Top-tagging-sized LGATr (lorentz-gatr / lloca `tag_lgatr` shape): 12 blocks, 16 mv / 32 s hidden
channels, 8 heads, attn_ratio 2, head_scale, mlp_ratio 2; in_mv 1 (embedded four-momenta), in_s 2,
out_mv 1, out_s 1. Input: 32 jets x 200 particles, f32.

    # write model + input + reference output (once), then time lgatr eagerly on CPU
    /work/venv/bin/python tools/bench/lgatr.py --dir /tmp/lgatr_bench --threads 2 --runs 3
    # peak RSS of one forward:
    /usr/bin/time -v /work/venv/bin/python tools/bench/lgatr.py --dir /tmp/lgatr_bench --runs 1 --no-save

The directory holds config.json + model.safetensors (the state dict), input.safetensors
(`multivectors`, `scalars`) and expected.safetensors (`outputs_mv`, `outputs_s`) so that edgerun runs
the same weights on the same input (`edgerun forward --model DIR --input DIR/input.safetensors
--output OUT --repeat 3`); tools/bench/compare.py runs the same comparison in its L-GATr row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# This file is itself called lgatr.py: keep its directory off sys.path so `import lgatr` is the package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from lgatr import LGATr, embed_vector  # noqa: E402

CONFIG = {
    "num_blocks": 12,
    "in_mv_channels": 1,
    "out_mv_channels": 1,
    "hidden_mv_channels": 16,
    "in_s_channels": 2,
    "out_s_channels": 1,
    "hidden_s_channels": 32,
    "attention": {"num_heads": 8, "attn_ratio": 2, "head_scale": True},
    "mlp": {"mlp_ratio": 2},
}


def make_input(batch: int, particles: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p3 = torch.randn(batch, particles, 3, generator=g)
    mass = 0.1 * torch.rand(batch, particles, 1, generator=g)
    e = torch.sqrt((p3**2).sum(-1, keepdim=True) + mass**2)
    mv = embed_vector(torch.cat([e, p3], -1)).unsqueeze(-2)  # (B, N, 1, 16)
    s = torch.randn(batch, particles, 2, generator=g)
    return mv.contiguous(), s.contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/lgatr_bench")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--particles", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dense-gp", action="store_true", help="primitives.sparse_gp=False (faster eager on CPU)")
    ap.add_argument("--no-save", action="store_true", help="do not (re)write the benchmark directory")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    cfg = dict(CONFIG)
    if args.dense_gp:
        cfg["primitives"] = {"sparse_gp": False}
    model = LGATr(**cfg).eval()
    mv, s = make_input(args.batch, args.particles)
    if not args.no_save:
        os.makedirs(args.dir, exist_ok=True)
        with open(os.path.join(args.dir, "config.json"), "w") as f:
            json.dump({"model_type": "lgatr", **CONFIG}, f, indent=2)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        safetensors.torch.save_file(state, os.path.join(args.dir, "model.safetensors"))
        safetensors.torch.save_file({"multivectors": mv, "scalars": s}, os.path.join(args.dir, "input.safetensors"))
    else:
        state = safetensors.torch.load_file(os.path.join(args.dir, "model.safetensors"))
        model.load_state_dict(state)

    times, cpu = [], []
    with torch.no_grad():
        for _ in range(args.runs):
            t0, c0 = time.perf_counter(), time.process_time()
            out_mv, out_s = model(mv, s)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    if not args.no_save:
        safetensors.torch.save_file(
            {"outputs_mv": out_mv.contiguous(), "outputs_s": out_s.contiguous()},
            os.path.join(args.dir, "expected.safetensors"),
        )
    params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "impl": f"lgatr {('sparse_gp=False' if args.dense_gp else 'default (sparse_gp)')} torch {torch.__version__}",
                "threads": args.threads,
                "batch": args.batch,
                "particles": args.particles,
                "params": params,
                "forward_s": [round(t, 3) for t in times],
                "min_s": round(min(times), 3),
                "cpu_s": [round(t, 2) for t in cpu],
                "min_cpu_s": round(min(cpu), 2),
                "max_abs_out": float(out_mv.abs().max()),
            }
        )
    )


if __name__ == "__main__":
    main()
