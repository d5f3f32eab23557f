"""Vision flags that several commands take, defined once (`tandem detect`, `tandem worker` and
`tandem serve --embedded`, `tandem streams`). argparse only: importing this loads no torch."""

from __future__ import annotations

import argparse


def add_max_image_pixels_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=None,
        help="inputs over this many pixels (width x height) are refused from their header, before "
        "decoding; a camera sending such frames goes down naming the limit and is retried "
        "(default: 8192 x 8192 = 67108864, 8x 4K)",
    )


def max_image_pixels_option(args: argparse.Namespace) -> dict:
    """{"max_image_pixels": N} for a VisionConfig when the flag is given (checked), else {}."""
    value = getattr(args, "max_image_pixels", None)
    if value is None:
        return {}
    if value < 1:
        raise ValueError(f"--max-image-pixels must be an integer >= 1, got {value}")
    return {"max_image_pixels": value}


def add_backend_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--backend",
        default="auto",
        help="the forward's engine: auto (default: the fastest of torch, onnxruntime and openvino by the "
        "start-up profile, each held within 0.5 mAP of float32; exports and rates are cached, so only a "
        "first start pays for them; with --no-profile, torch), torch (Ultralytics' parity path), "
        "onnxruntime or openvino (Ultralytics' export of the same weights); runtime/vision/backends.py",
    )


def parse_class_ids(text: str, flag: str = "--classes") -> tuple[int, ...]:
    """`0,2` -> (0, 2); ValueError naming `flag` otherwise."""
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated class ids like 0,2, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"{flag}: class ids are >= 0, got {text!r}")
    return ids
