"""Peak memory of `edgerun chm --tile 416` on orthomosaics as exported (issue #47): a JPEG-compressed
YCbCr GeoTIFF (256-px tiles with JPEGTables, as GDAL's COMPRESS=JPEG PHOTOMETRIC=YCBCR writes it)
against a Deflate one of the same pixels, at two raster sizes, and a baseline JPEG far beyond the
whole-image limits (read by rows; stopped after --jpeg-seconds).

    cargo build --release
    .venv/bin/python tools/bench/orthomosaic_rss.py --binary target/release/edgerun \\
        --model tests/fixtures/chmv2_tiny

Prints one line per run: input, size, exit, wall seconds, peak RSS (KiB, from /usr/bin/time -v).
"""
import argparse
import os
import re
import subprocess
import sys

import numpy as np
import tifffile
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "fixtures"))
import orthomosaic as om  # noqa: E402

Image.MAX_IMAGE_PIXELS = None


def big_scene(w, h, band=512):
    """The fixture scene at w x h, built in bands of rows (bounded float memory)."""
    out = np.empty((h, w, 3), np.uint8)
    for y in range(0, h, band):
        out[y : y + band] = om.scene(w, min(band, h - y), y0=y, seed=y)
    return out


def write_geotiffs(img, stem):
    tables, data = om.jpeg_chunks(om.tiles(img, 256), colorspace="RGB", outcolorspace="YCBCR", subsampling="420")
    jpeg = f"{stem}.jpeg.tif"
    with tifffile.TiffWriter(jpeg, bigtiff=False) as w:
        w.write(iter(data), shape=img.shape, dtype=np.uint8, photometric="ycbcr", subsampling=(2, 2),
                compression="jpeg", tile=(256, 256), jpegtables=tables, extratags=om.GEO)
    deflate = f"{stem}.deflate.tif"
    tifffile.imwrite(deflate, img, photometric="rgb", tile=(256, 256), compression="zlib", predictor=True, extratags=om.GEO)
    return [jpeg, deflate]


def run(binary, model, path, out, timeout=None):
    cmd = ["/usr/bin/time", "-v"]
    if timeout:
        cmd += ["timeout", "-s", "TERM", str(timeout)]
    cmd += [binary, "chm", "--model", model, path, "--out", out, "--tile", "416", "--batch", "1", "--device", "cpu", "--progress", "none"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", p.stderr)
    size = os.path.getsize(path)
    print(f"{os.path.basename(path)}\t{size} B\texit {p.returncode}\twall {wall.group(1) if wall else '?'}\tpeak RSS {rss.group(1) if rss else '?'} KiB", flush=True)
    if p.returncode not in (0, 124):
        print(p.stderr[-2000:], file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="target/release/edgerun")
    ap.add_argument("--model", default="tests/fixtures/chmv2_tiny")
    ap.add_argument("--workdir", default="/tmp/edgerun-bench/orthomosaic")
    ap.add_argument("--sizes", nargs="+", default=["4096x4096", "8192x4096"])
    ap.add_argument("--jpeg", default="16000x12000", help="the baseline JPEG beyond the image limits")
    ap.add_argument("--jpeg-seconds", type=int, default=120)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    for size in a.sizes:
        w, h = map(int, size.split("x"))
        for path in write_geotiffs(big_scene(w, h), os.path.join(a.workdir, f"r{w}x{h}")):
            run(a.binary, a.model, path, os.path.join(a.workdir, "out"))
    if a.jpeg:
        w, h = map(int, a.jpeg.split("x"))
        path = os.path.join(a.workdir, f"big{w}x{h}.jpg")
        Image.fromarray(big_scene(w, h)).save(path, quality=85)
        run(a.binary, a.model, path, os.path.join(a.workdir, "out"), timeout=a.jpeg_seconds)


if __name__ == "__main__":
    main()
