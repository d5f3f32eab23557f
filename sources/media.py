"""Decoding single images and video files into BGR uint8 arrays, with errors that say why.

Decoding never raises for a bad file: it returns an error string, so one corrupt image in
a directory of thousands costs one error entry, not the run.

Every image is sized from its header before it is decoded (`image_size`, `decode_image`):
one over `max_image_pixels` (sources.base.DEFAULT_MAX_IMAGE_PIXELS) is refused without
decoding it, since a small file can declare a frame that costs gigabytes. Bytes whose format
cannot be identified are refused too, rather than decoded blind.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator

import cv2
import numpy as np

from sources.base import DEFAULT_MAX_IMAGE_PIXELS, Frame

# Formats sized by Pillow's lazy open (it parses the header, decodes nothing) that OpenCV also
# decodes, so both read the same header; WebP, GIF, PFM and Radiance HDR are parsed here (Pillow
# reads no PFM or HDR, and its WebP open allocates the canvas). Formats only one of them reads
# are refused: Pillow could not vouch for the size OpenCV would decode.
_PILLOW_FORMATS = ("JPEG", "PNG", "BMP", "PPM", "TIFF", "JPEG2000", "SUN", "AVIF")
FORMATS = "JPEG, PNG, WebP, BMP, TIFF, GIF, JPEG 2000, PNM, PFM, Sun raster, AVIF, Radiance HDR"
_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")


class ImageError(ValueError):
    """An image that is refused; the message names the input (and the limit, if that is why)."""


class NotAnImage(ImageError):
    """Bytes that are no image format we decode, or whose header is corrupt."""


class ImageTooLarge(ImageError):
    """An image whose header declares more pixels than max_image_pixels."""


def _mpx(pixels: int) -> str:
    return f"{pixels / 1e6:.1f} Mpx"


def check_pixels(width: int, height: int, what: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
    """ImageTooLarge naming `what` and the limit when width x height is over `max_pixels`."""
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"{what}: {width}x{height} = {_mpx(width * height)} is over the limit of "
            f"{_mpx(max_pixels)} (max_image_pixels)"
        )


def _own_header(data: bytes) -> tuple[str, int, int] | None:
    """(format, width, height) of the formats parsed here; None if it is none of them."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        chunk = data[12:16]
        if chunk == b"VP8X" and len(data) >= 30:
            return "WEBP", 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
        if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
            bits = int.from_bytes(data[21:25], "little")
            return "WEBP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
            return (
                "WEBP",
                int.from_bytes(data[26:28], "little") & 0x3FFF,
                int.from_bytes(data[28:30], "little") & 0x3FFF,
            )
        raise NotAnImage("not a readable WebP image: its header is corrupt")
    if data[:6] in (b"GIF87a", b"GIF89a"):
        if len(data) < 10:
            raise NotAnImage("not a readable GIF image: its header is truncated")
        return "GIF", int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    if data[:2] in (b"PF", b"Pf") and data[2:3].isspace():
        parts = data[:256].split()
        try:
            return "PFM", int(parts[1]), int(parts[2])
        except (IndexError, ValueError):
            raise NotAnImage("not a readable PFM image: its header is corrupt") from None
    if data[:2] == b"#?":  # Radiance HDR: header lines, a blank line, then e.g. "-Y 480 +X 640"
        head = data[: 64 << 10]
        end = head.find(b"\n\n")
        tokens = head[end + 2 :].split(b"\n", 1)[0].split() if end >= 0 else []
        sizes = {t[1:2]: v for t, v in zip(tokens[::2], tokens[1::2]) if t[:1] in b"+-" and len(t) == 2}
        try:
            return "HDR", int(sizes[b"X"]), int(sizes[b"Y"])
        except (KeyError, ValueError):
            raise NotAnImage("not a readable Radiance HDR image: its header is corrupt") from None
    return None


def _pillow_header(data: bytes) -> tuple[str, int, int] | None:
    """(format, width, height) from Pillow's lazy open of the formats in _PILLOW_FORMATS.

    Pillow's plugins are called directly, as Image.open does, but without its process-wide
    decompression-bomb check (Image.MAX_IMAGE_PIXELS), whose warning and error would stand
    in for our limit. A plugin that runs that check itself (some do, for some files) raises
    ImageTooLarge from here.
    """
    from PIL import Image

    prefix = data[:16]
    for load in (Image.preinit, Image.init):  # the common plugins first, all of them if needed
        load()
        for fmt in _PILLOW_FORMATS:
            if fmt not in Image.OPEN:
                continue
            factory, accept = Image.OPEN[fmt]
            if accept is not None:
                accepted = accept(prefix)
                if not accepted or isinstance(accepted, str):  # a str: this format, but unsupported
                    continue
            try:
                im = factory(io.BytesIO(data), "")
            except Image.DecompressionBombError as exc:
                m = _BOMB_PIXELS.search(str(exc))
                pixels = int(m.group(1)) if m else 2 * (Image.MAX_IMAGE_PIXELS or 0) + 1
                raise ImageTooLarge(
                    f"{_mpx(pixels)} (a {fmt} header), over Pillow's decompression-bomb limit "
                    f"of {_mpx(2 * (Image.MAX_IMAGE_PIXELS or 0))}"
                ) from None
            except Exception as exc:  # noqa: BLE001 - any parser error means a corrupt header
                raise NotAnImage(
                    f"not a readable {fmt} image: its header is corrupt ({type(exc).__name__}: {exc})"
                ) from None
            (width, height), name = im.size, im.format
            if fmt == "TIFF":
                width, height = _tiff_buffer(im, width, height)
            im.close()
            return ("MPO" if name == "MPO" else fmt), width, height
    return None


def _tiff_buffer(im, width: int, height: int) -> tuple[int, int]:
    """The size to check for a TIFF: its image, or a tile if that is larger. OpenCV's TIFF
    decoder allocates a whole tile (TileWidth x TileLength, tags 322 and 323), so a 1 x 1 image
    declaring 14000 x 14000 tiles cost 750 MB though its header said one pixel. (Strips need
    no such check: the decoder clamps RowsPerStrip to the image's height.)"""
    tags = im.tag_v2
    tile_w, tile_h = tags.get(322), tags.get(323)
    if tile_w and tile_h and tile_w * tile_h > width * height:
        return int(tile_w), int(tile_h)
    return width, height


def _identify(data: bytes) -> tuple[str, int, int]:
    header = _own_header(data) or _pillow_header(data)
    if header is None:
        raise NotAnImage(
            f"not an image format this server decodes ({FORMATS}): {len(data)} bytes starting {bytes(data[:8])!r}"
        )
    fmt, width, height = header
    if width < 1 or height < 1:
        raise NotAnImage(f"not a readable {fmt} image: its header says {width}x{height}")
    return header


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) that `data`'s header declares, read without decoding any pixel.
    NotAnImage (a ValueError) when it is no format we decode or its header is corrupt;
    ImageTooLarge if Pillow's own bomb check refused the header outright."""
    _, width, height = _identify(bytes(data))
    return width, height


def _decode(data: bytes, what: str, max_pixels: int) -> np.ndarray:
    """decode_image's work; a NotAnImage here says why without naming `what`."""
    if not data:
        raise NotAnImage("the image is empty (0 bytes)")
    try:
        fmt, width, height = _identify(data)
    except ImageTooLarge as exc:
        raise ImageTooLarge(f"{what}: {exc}; the limit is {_mpx(max_pixels)} (max_image_pixels)") from None
    check_pixels(width, height, what, max_pixels)
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)  # always 3-channel uint8
    if image is None:
        raise NotAnImage(f"cannot decode this {fmt} image ({len(data)} bytes): corrupt or truncated")
    # The header is what was checked; a decoder that disagreed with it is caught here.
    check_pixels(image.shape[1], image.shape[0], what, max_pixels)
    return image


def decode_image(data: bytes, what: str = "image", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """`data` (encoded image bytes) decoded to BGR uint8, once its header says it has at most
    `max_pixels` pixels; else ImageTooLarge, never decoding it. Every ImageError (a
    ValueError) starts with `what`, e.g. "image: 20000x20000 = 400.0 Mpx is over the limit of
    67.1 Mpx (max_image_pixels)"."""
    try:
        return _decode(bytes(data), what, max_pixels)
    except NotAnImage as exc:
        raise NotAnImage(f"{what}: {exc}") from None


def read_image(path: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[np.ndarray | None, str | None]:
    """(image, None) or (None, error). Reading the bytes and decoding them (not cv2.imread) also
    reads non-ASCII paths, which cv2.imread cannot on every platform, and checks the header
    against `max_pixels` before anything is decoded."""
    if not os.path.isfile(path):
        return None, f"file not found: {path}"
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    if not data:
        return None, f"cannot decode image {path}: the file is empty"
    try:
        return _decode(data, f"image {path}", max_pixels), None
    except ImageTooLarge as exc:
        return None, str(exc)
    except NotAnImage as exc:
        return None, f"cannot decode image {path}: {exc}"


def to_bgr(value: object, name: str, max_pixels: int | None = None) -> np.ndarray:
    """An in-memory input as a BGR uint8 H x W x 3 array; ValueError names what is wrong.

    numpy arrays are taken as BGR (OpenCV's and Ultralytics' convention); PIL images are RGB
    and are converted, as Ultralytics does. `max_pixels`: refuse (ImageTooLarge) an input
    with more pixels, before converting it; None: no limit (it is decoded already).
    """
    if isinstance(value, np.ndarray):
        image = value
        if max_pixels is not None and image.ndim >= 2:
            check_pixels(image.shape[1], image.shape[0], name, max_pixels)
    elif type(value).__module__.startswith("PIL."):
        if max_pixels is not None:
            check_pixels(value.size[0], value.size[1], name, max_pixels)
        pil = value.convert("RGB") if value.mode != "RGB" else value
        image = np.asarray(pil)[:, :, ::-1]
    else:
        raise ValueError(f"{name}: expected a numpy array, a PIL image or a path, got {type(value).__name__}")
    if image.ndim == 2:
        image = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    if image.ndim != 3 or image.shape[2] not in (3, 4):
        raise ValueError(f"{name}: expected an H x W x 3 (BGR) array, got shape {tuple(image.shape)}")
    if image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"{name}: the image is empty, shape {tuple(image.shape)}")
    if image.dtype != np.uint8:
        raise ValueError(f"{name}: expected dtype uint8 (0..255), got {image.dtype}")
    if image.shape[2] == 4:
        image = cv2.cvtColor(image, cv2.COLOR_BGRA2BGR)
    return np.ascontiguousarray(image)


def count_video_frames(path: str, vid_stride: int) -> int | None:
    cap = cv2.VideoCapture(path)
    try:
        n = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) if cap.isOpened() else 0
    finally:
        cap.release()
    return (n + vid_stride - 1) // vid_stride if n > 0 else None


def capture_size_error(cap: cv2.VideoCapture, what: str, max_pixels: int) -> str | None:
    """The error for an opened VideoCapture whose frames are over `max_pixels`, from the size
    it reports (CAP_PROP_FRAME_WIDTH x HEIGHT), before any frame is read; None if within it
    (or not reported: then the frames read are checked instead)."""
    width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
    try:
        check_pixels(width, height, what, max_pixels)
    except ImageTooLarge as exc:
        return str(exc)
    return None


def iter_video(path: str, vid_stride: int = 1, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Iterator[Frame]:
    """Every `vid_stride`-th frame of a video file (frames 0, s, 2s, ...).

    Skipped frames are only grabbed, not decoded, which is most of a decode's cost. A video
    that cannot be opened, or whose frames are over `max_pixels`, yields one error frame; one
    that breaks midway yields what it read.
    """
    if not os.path.isfile(path):
        yield Frame(path, error=f"file not found: {path}")
        return
    cap = cv2.VideoCapture(path)
    try:
        if not cap.isOpened():
            yield Frame(path, error=f"cannot open video {path}: not a video, or a corrupt one")
            return
        too_large = capture_size_error(cap, f"video {path}", max_pixels)
        if too_large:
            yield Frame(path, error=too_large)
            return
        index, produced = 0, 0
        while True:
            if index % vid_stride == 0:
                ok, image = cap.read()
                if not ok:
                    break
                try:  # a size the capture did not report (0 x 0) is checked on the frames
                    check_pixels(image.shape[1], image.shape[0], f"video {path} frame {index}", max_pixels)
                except ImageTooLarge as exc:
                    yield Frame(path, index=index, error=str(exc))
                    return
                produced += 1
                yield Frame(path, index=index, image=image)
            elif not cap.grab():
                break
            index += 1
        if produced == 0:
            yield Frame(path, error=f"cannot decode video {path}: no frame could be read")
    finally:
        cap.release()
