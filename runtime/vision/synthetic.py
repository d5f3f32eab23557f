"""A generated detection dataset with exact boxes: shapes drawn with OpenCV, seeded.

No pretrained detector can be downloaded here, so Tandem trains its own small one (issue 11):
every image holds a few filled circles, squares and triangles, in random colours and sizes, on a
noisy background with distractor lines. Each box is computed from the geometry that was drawn
(clipped to the image), so labels are exact, and the same seed gives the same dataset byte for
byte. The layout is Ultralytics' (images/<split>/*.jpg, labels/<split>/*.txt with
`class cx cy w h` normalised, and a data YAML), so its trainer and validator read it as is.

    python -m runtime.vision.synthetic OUT_DIR --train 800 --val 200 --imgsz 320

The same kinds of shapes moving across a still background, the test camera of
`python -m sources.loopback`, are drawn by sources/scene.py (below this floor, for the camera).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import cv2
import numpy as np

from runtime.vision.detector import CLASSES


def draw_image(
    rng: np.random.Generator, size: int, max_objects: int = 6
) -> tuple[np.ndarray, list[tuple[int, float, float, float, float]]]:
    """One BGR image [size, size, 3] and its labels [(class, x1, y1, x2, y2)] in pixels."""
    base = rng.integers(0, 256, 3)
    img = np.clip(base + rng.normal(0, 18, (size, size, 3)), 0, 255).astype(np.uint8)
    for _ in range(int(rng.integers(0, 4))):  # distractors: lines are not objects
        p1, p2 = rng.integers(0, size, 2), rng.integers(0, size, 2)
        cv2.line(
            img,
            (int(p1[0]), int(p1[1])),
            (int(p2[0]), int(p2[1])),
            rng.integers(0, 256, 3).tolist(),
            int(rng.integers(1, 4)),
        )
    labels = []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        cls = int(rng.integers(0, len(CLASSES)))
        r = float(rng.uniform(0.05, 0.18) * size)  # half size
        cx, cy = rng.uniform(r, size - r, 2)
        colour = rng.integers(0, 256, 3)
        if np.abs(colour.astype(int) - base).sum() < 120:  # keep objects visible against the background
            colour = 255 - colour
        colour = colour.tolist()
        if cls == 0:
            cv2.circle(img, (round(cx), round(cy)), round(r), colour, -1, cv2.LINE_AA)
            box = (cx - r, cy - r, cx + r, cy + r)
        else:
            n = 4 if cls == 1 else 3
            angle = rng.uniform(0, 2 * math.pi)
            pts = np.array(
                [
                    (cx + r * math.cos(angle + 2 * math.pi * k / n), cy + r * math.sin(angle + 2 * math.pi * k / n))
                    for k in range(n)
                ]
            )
            cv2.fillPoly(img, [np.round(pts).astype(np.int32)], colour, cv2.LINE_AA)
            box = (pts[:, 0].min(), pts[:, 1].min(), pts[:, 0].max(), pts[:, 1].max())
        x1, y1, x2, y2 = (float(np.clip(v, 0, size)) for v in box)
        labels.append((cls, x1, y1, x2, y2))
    return img, labels


def write_split(out: str | Path, split: str, count: int, imgsz: int, rng: np.random.Generator) -> None:
    """Draw `count` images from `rng` into out/images/<split> and out/labels/<split>."""
    out = Path(out)
    (out / "images" / split).mkdir(parents=True, exist_ok=True)
    (out / "labels" / split).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        img, labels = draw_image(rng, imgsz)
        cv2.imwrite(str(out / "images" / split / f"{i:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
        lines = [
            f"{c} {(x1 + x2) / 2 / imgsz:.6f} {(y1 + y2) / 2 / imgsz:.6f} {(x2 - x1) / imgsz:.6f} {(y2 - y1) / imgsz:.6f}"
            for c, x1, y1, x2, y2 in labels
        ]
        (out / "labels" / split / f"{i:05d}.txt").write_text("\n".join(lines) + "\n")


def _data_yaml(out: Path, val_split: str) -> Path:
    data = out / "data.yaml"
    names = "\n".join(f"  {i}: {n}" for i, n in enumerate(CLASSES))
    data.write_text(f"path: {out.resolve()}\ntrain: images/train\nval: images/{val_split}\nnames:\n{names}\n")
    return data


def write_dataset(out: str | Path, train: int = 800, val: int = 200, imgsz: int = 320, seed: int = 0) -> Path:
    """Write the training dataset (train and val splits) under `out`; returns its data YAML."""
    out = Path(out)
    rng = np.random.default_rng(seed)
    for split, count in (("train", train), ("val", val)):
        write_split(out, split, count, imgsz, rng)
    return _data_yaml(out, "val")


# The held-out test set that accuracy is reported on: drawn from a seed training never used, so
# neither the weights nor the choice of best epoch (made on the val split) have seen it.
TEST_SEED = 1000


def write_test_set(out: str | Path, count: int = 200, imgsz: int = 320, seed: int = TEST_SEED) -> Path:
    """Write a held-out split `test` under `out`; returns a data YAML whose val split is it
    (Ultralytics' validator reads `val`)."""
    out = Path(out)
    write_split(out, "test", count, imgsz, np.random.default_rng(seed))
    return _data_yaml(out, "test")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--train", type=int, default=800)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(write_dataset(a.out, a.train, a.val, a.imgsz, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
