"""The vision demo: bus.jpg, zidane.jpg and a short generated video through the dynamic batcher.

Prints one line per input (source, frame, boxes, top classes, stage timings, batch size) and
the batch sizes the scheduler chose. Runs in well under 30 s on a laptop CPU.
"""

from __future__ import annotations

import os
import tempfile

IMGSZ = 320


def _video(path: str, frames: int = 6) -> None:
    import cv2

    from sources.loopback import synthetic_frames

    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 10, (320, 240))
    for image in synthetic_frames(frames):
        writer.write(image)
    writer.release()


def demo_config():
    from runtime.vision.config import VisionConfig, vision_batching

    # Random weights score ~1e-4 everywhere, so a tiny threshold shows the plumbing works.
    batching = vision_batching(max_batch_size=4, max_queue_delay_ms=10.0)
    return VisionConfig(imgsz=IMGSZ, conf=0.0001, batching=batching, profile_iters=1)


def run_vision_demo(engine=None) -> None:
    """Run the demo inputs through `engine` (a VisionEngine), or through a new one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from contextlib import nullcontext

    from runtime.vision.ultralytics_import import import_ultralytics

    import_ultralytics()
    from ultralytics.utils import ASSETS

    from runtime.vision.engine import VisionEngine
    from sources import load_source

    with tempfile.TemporaryDirectory() as tmp:
        clip = os.path.join(tmp, "clip.mp4")
        _video(clip)
        inputs = [str(ASSETS / "bus.jpg"), str(ASSETS / "zidane.jpg"), clip]
        with nullcontext(engine) if engine is not None else VisionEngine(demo_config()) as engine:
            print(f"model: {engine.runner.description}")
            print(f"profiled images/s by batch size: {engine.stats()['profile_images_per_s']}; "
                  f"preferred {list(engine.preferred_batch_sizes)}")  # fmt: skip
            source = load_source(inputs)
            jobs = [(frame, engine.submit(frame)) for frame in source]  # all at once: the batcher groups them
            for frame, future in jobs:
                d = future.result()
                top = ", ".join(f"{n} {c:.4f}" for n, c in list(zip(d.names, d.conf))[:3])
                t = d.timings
                print(f"{os.path.basename(frame.source):>10s} frame {frame.index}: {len(d):3d} boxes "
                      f"[{top}] batch {d.batch_size} pre {t['preprocess']:.1f} ms inf {t['inference']:.1f} ms "
                      f"post {t['postprocess']:.1f} ms")  # fmt: skip
            print(f"batch sizes chosen: {engine.scheduler.batch_sizes}")


if __name__ == "__main__":
    run_vision_demo()
