"""A generated scene for test cameras: circles, squares and triangles (the shapes the shipped
detector was trained on, runtime/vision/synthetic.py, in its label order) gliding over a still
background. Here, on the sources floor, so the loopback camera (sources/loopback.py) can draw
it without importing the runtime above it."""

from __future__ import annotations

import math

import cv2
import numpy as np

SHAPES = ("circle", "square", "triangle")  # runtime.vision.detector.CLASSES, the label order


def moving_scene(n: int, width: int = 320, height: int = 240, seed: int = 0, objects: int = 3) -> list[np.ndarray]:
    """`n` BGR frames of `objects` shapes (one of each class in turn) gliding and bouncing
    over a fixed noisy background: what a still camera over moving objects sees. Sizes are in
    the range the shipped detector was trained on (half sizes 5 to 18% of the image)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(40, 200, 3)
    background = np.clip(base + rng.normal(0, 18, (height, width, 3)), 0, 255).astype(np.uint8)
    short = min(width, height)
    shapes = []
    for k in range(objects):
        r = float(rng.uniform(0.10, 0.16) * short)
        pos = rng.uniform([r, r], [width - r, height - r])
        vel = rng.uniform(-1, 1, 2)
        vel = vel / (np.linalg.norm(vel) + 1e-9) * short * 0.02  # about 2% of the image a frame
        colour = 255 - base if k % 2 == 0 else rng.integers(0, 256, 3)
        if np.abs(colour.astype(int) - base).sum() < 120:
            colour = 255 - base
        shapes.append([k % len(SHAPES), r, pos, vel, colour.tolist(), float(rng.uniform(0, 2 * math.pi))])
    frames = []
    for _ in range(n):
        img = background.copy()
        for shape in shapes:
            cls, r, pos, vel, colour, angle = shape
            if cls == 0:
                cv2.circle(img, (round(pos[0]), round(pos[1])), round(r), colour, -1, cv2.LINE_AA)
            else:
                m = 4 if cls == 1 else 3
                pts = [
                    (
                        pos[0] + r * math.cos(angle + 2 * math.pi * j / m),
                        pos[1] + r * math.sin(angle + 2 * math.pi * j / m),
                    )
                    for j in range(m)
                ]
                cv2.fillPoly(img, [np.round(np.array(pts)).astype(np.int32)], colour, cv2.LINE_AA)
            for axis, limit in ((0, width), (1, height)):  # bounce off the edges
                if not r <= pos[axis] + vel[axis] <= limit - r:
                    vel[axis] = -vel[axis]
            pos += vel
            shape[5] = angle + 0.03
        frames.append(img)
    return frames
