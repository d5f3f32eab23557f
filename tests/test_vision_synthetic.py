"""The generated shapes dataset (runtime/vision/synthetic.py): exact, seeded, in Ultralytics' layout."""

from __future__ import annotations

import numpy as np

from runtime.vision.synthetic import CLASSES, draw_image, write_dataset


def test_same_seed_same_dataset_other_seed_other(tmp_path):
    a = write_dataset(tmp_path / "a", train=4, val=2, imgsz=64, seed=3)
    b = write_dataset(tmp_path / "b", train=4, val=2, imgsz=64, seed=3)
    c = write_dataset(tmp_path / "c", train=4, val=2, imgsz=64, seed=4)
    files = sorted(p.relative_to(a.parent) for p in a.parent.rglob("*") if p.is_file() and p.name != "data.yaml")
    assert len(files) == 2 * (4 + 2)
    assert all((a.parent / f).read_bytes() == (b.parent / f).read_bytes() for f in files)
    assert any((a.parent / f).read_bytes() != (c.parent / f).read_bytes() for f in files)
    yaml = a.read_text()
    assert "train: images/train" in yaml and "val: images/val" in yaml and all(n in yaml for n in CLASSES)


def test_labels_are_normalised_boxes_of_known_classes(tmp_path):
    data = write_dataset(tmp_path, train=20, val=0, imgsz=96, seed=0)
    rows = [
        line.split() for f in (data.parent / "labels" / "train").glob("*.txt") for line in f.read_text().splitlines()
    ]
    assert rows and all(len(r) == 5 for r in rows)
    for cls, cx, cy, w, h in ((int(r[0]), *map(float, r[1:])) for r in rows):
        assert 0 <= cls < len(CLASSES)
        assert 0 < w <= 1 and 0 < h <= 1
        assert 0 <= cx - w / 2 + 1e-6 and cx + w / 2 <= 1 + 1e-6 and 0 <= cy - h / 2 + 1e-6 and cy + h / 2 <= 1 + 1e-6


def test_each_box_is_tight_around_what_was_drawn():
    """Drawn alone on a flat background, every shape's painted pixels span its box to within
    the anti-aliasing pixel: the label is the geometry, not a guess."""
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(40):
        img, labels = draw_image(rng, 128, max_objects=1)
        ((cls, x1, y1, x2, y2),) = labels
        # The background is noise around one colour: pixels far from the median colour are painted.
        diff = np.abs(img.astype(int) - np.median(img.reshape(-1, 3), axis=0)).sum(-1)
        ys, xs = np.nonzero(diff > 150)
        inside = (xs >= x1 - 2) & (xs <= x2 + 2) & (ys >= y1 - 2) & (ys <= y2 + 2)
        if len(xs) < 50 or inside.mean() < 0.9:  # a line or a low-contrast colour dominates: skip
            continue
        ys, xs = ys[inside], xs[inside]
        assert abs(xs.min() - x1) <= 2.5 and abs(xs.max() - x2) <= 2.5, (cls, xs.min(), xs.max(), x1, x2)
        assert abs(ys.min() - y1) <= 2.5 and abs(ys.max() - y2) <= 2.5, (cls, ys.min(), ys.max(), y1, y2)
        checked += 1
    assert checked >= 10
