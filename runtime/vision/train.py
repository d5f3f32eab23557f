"""Train Tandem's small detector on the generated shapes dataset (runtime/vision/synthetic.py).

Ultralytics' own trainer on CPU, from the yolo26n YAML (no pretrained weights exist here),
seeded and offline. Measured on the 2-core development machine at imgsz 320, batch 16: about
60 s an epoch for 600 training images plus 9 s of validation, so a few tens of epochs take
half an hour to an hour. The trainer writes best.pt; its validation mAP50-95 on the held-out
generated split is printed at the end.

    python -m runtime.vision.train --out runs/shapes --epochs 40
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def train(
    out: str | Path,
    epochs: int,
    train_images: int = 600,
    val_images: int = 150,
    imgsz: int = 320,
    batch: int = 16,
    seed: int = 0,
) -> dict:
    from runtime.vision.synthetic import write_dataset
    from runtime.vision.ultralytics_import import import_ultralytics

    os.environ.setdefault("YOLO_OFFLINE", "1")
    out = Path(out).resolve()
    data = write_dataset(out / "data", train_images, val_images, imgsz, seed)
    import_ultralytics()
    from ultralytics import YOLO

    t0 = time.perf_counter()
    model = YOLO("yolo26n.yaml")
    result = model.train(
        data=str(data),
        epochs=epochs,
        imgsz=imgsz,
        batch=batch,
        device="cpu",
        workers=0,
        seed=seed,
        deterministic=True,
        plots=False,
        amp=False,
        project=str(out),
        name="train",
        exist_ok=True,
    )
    metrics = dict(result.results_dict) if result is not None else {}
    return {
        "seconds": time.perf_counter() - t0,
        "weights": str(out / "train" / "weights" / "best.pt"),
        "metrics": metrics,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/shapes")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--train-images", type=int, default=600)
    p.add_argument("--val-images", type=int, default=150)
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name in ("epochs", "train_images", "val_images", "imgsz"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    report = train(a.out, a.epochs, a.train_images, a.val_images, a.imgsz, seed=a.seed)
    print(f"trained in {report['seconds']:.0f} s -> {report['weights']}")
    for k, v in report["metrics"].items():
        print(f"  {k}: {v:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
