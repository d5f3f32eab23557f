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
