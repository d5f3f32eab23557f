"""The vision demo: Tandem's trained shapes detector on held-out generated images and a short
generated video, through the dynamic batcher.

Prints, per input, what the detector found beside what was drawn (the generator knows every
shape it painted), the stage timings and the batch size, then the batch sizes the scheduler
chose. Runs in well under 30 s on a laptop CPU.
"""

from __future__ import annotations

import os
import tempfile

from runtime.vision.detector import IMGSZ, WEIGHTS


def demo_scenes(n: int, seed: int) -> list[tuple[object, list[str]]]:
    """`n` generated images (BGR) with the class names of the shapes drawn in each, from a
    seed training never used."""
    import numpy as np

    from runtime.vision.synthetic import CLASSES, draw_image

    rng = np.random.default_rng(seed)
    scenes = []
    for _ in range(n):
        img, labels = draw_image(rng, IMGSZ)
        scenes.append((img, sorted(CLASSES[c] for c, *_ in labels)))
    return scenes


def _video(path: str, frames: list) -> None:
    import cv2

    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 10, (IMGSZ, IMGSZ))
    for image in frames:
        writer.write(image)
    writer.release()


def demo_config():
    from runtime.vision.config import VisionConfig, vision_batching

    if not WEIGHTS.is_file():
        raise FileNotFoundError(
            f"the shipped detector {WEIGHTS} is missing; retrain it with "
            f"`python -m runtime.vision.train` (see runtime/vision/detector.py)"
        )
    batching = vision_batching(max_batch_size=4, max_queue_delay_ms=10.0)
    # torch, not the CLI's "auto": from a clean cache, auto's two exports and three timed
    # backends took the vision start-up from 1.8 s to 22.3 s (17.3 s of it exporting; shipped
    # detector, 2 busy cores), most of the demo's budget, for a few images.
    return VisionConfig(model=str(WEIGHTS), imgsz=IMGSZ, batching=batching, profile_iters=1, backend="torch")


def describe(detections) -> str:
    """'circle 0.93, square 0.88' for a Detections, highest confidence first."""
    found = sorted(zip(detections.conf, detections.names), reverse=True)
    return ", ".join(f"{name} {conf:.2f}" for conf, name in found) or "nothing"


def run_vision_demo(engine=None) -> None:
    """Run the demo inputs through `engine` (a VisionEngine), or through a new one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from contextlib import nullcontext

    import cv2

    from runtime.vision.engine import VisionEngine
    from runtime.vision.synthetic import TEST_SEED
    from sources import load_source

    scenes = demo_scenes(8, TEST_SEED + 1)
    with tempfile.TemporaryDirectory() as tmp:
        inputs = []
        for i, (img, _) in enumerate(scenes[:4]):
            inputs.append(os.path.join(tmp, f"shapes{i}.jpg"))
            cv2.imwrite(inputs[-1], img)
        clip = os.path.join(tmp, "clip.mp4")
        _video(clip, [img for img, _ in scenes[4:]])
        inputs.append(clip)
        truth = {(p, 0): names for p, (_, names) in zip(inputs, scenes)}
        truth.update({(clip, k): names for k, (_, names) in enumerate(scenes[4:])})
        with nullcontext(engine) if engine is not None else VisionEngine(demo_config()) as engine:
            print(f"model: {engine.runner.description}")
            print(
                f"profiled images/s by batch size: {engine.stats()['profile_images_per_s']}; "
                f"preferred {list(engine.preferred_batch_sizes)}"
            )
            source = load_source(inputs)
            jobs = [(frame, engine.submit(frame)) for frame in source]  # all at once: the batcher groups them
            for frame, future in jobs:
                d = future.result()
                t = d.timings
                print(f"{os.path.basename(frame.source):>11s} frame {frame.index}: found [{describe(d)}]")
                print(
                    f"{'':>20s}drawn [{', '.join(truth.get((frame.source, frame.index), ['?']))}]; batch {d.batch_size}, "
                    f"pre {t['preprocess']:.1f} ms, inf {t['inference']:.1f} ms, post {t['postprocess']:.1f} ms"
                )
            print(f"batch sizes chosen: {engine.scheduler.batch_sizes}")


if __name__ == "__main__":
    run_vision_demo()
