"""Generates the bundled example images (synthetic aerial-like scenes, deterministic)."""
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

OUT = os.path.join(os.path.dirname(__file__), "..", "examples", "images")


def scene(seed: int, w: int, h: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    ground = np.stack([90 + 40 * np.sin(xx / 37 + seed), 120 + 30 * np.cos(yy / 23), 70 + 20 * np.sin((xx + yy) / 51)], -1)
    ground += rng.normal(0, 12, ground.shape)
    img = Image.fromarray(np.clip(ground, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    for _ in range(6):  # buildings
        x, y = rng.integers(0, w - 30), rng.integers(0, h - 30)
        s = rng.integers(12, 30)
        d.rectangle([x, y, x + s, y + s], fill=tuple(int(v) for v in rng.integers(150, 230, 3)))
    d.line([(0, rng.integers(0, h)), (w, rng.integers(0, h))], fill=(60, 60, 60), width=6)  # road
    for _ in range(12):  # trees
        x, y, r = rng.integers(0, w), rng.integers(0, h), rng.integers(4, 10)
        d.ellipse([x - r, y - r, x + r, y + r], fill=(30, int(rng.integers(90, 140)), 40))
    return img.filter(ImageFilter.GaussianBlur(0.6))


def main():
    os.makedirs(OUT, exist_ok=True)
    for i, (w, h) in enumerate([(160, 120), (200, 150), (120, 160)]):
        scene(i, w, h).save(os.path.join(OUT, f"scene_{i}.jpg"), quality=90)
    scene(7, 96, 96).save(os.path.join(OUT, "scene_3.png"))


if __name__ == "__main__":
    main()
