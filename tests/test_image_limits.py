"""Image bombs: a few hundred bytes that declare a 20000 x 20000 image (400 Mpx, 1.2 GB as BGR)
are refused from their header, before anything is decoded, at every entry point: bytes
(`sources.media`), files, directories and videos (`load_source`), MJPEG stream parts and
captures (`StreamsSource`, the camera service), the engine's batch decode, the worker's
`tandem.detect` job (upload and URL), and `POST /v1/detect` (in process, and over a real worker
with Redis). Each refusal names the limit (max_image_pixels), and the process's peak memory
stays within BOMB_GROWTH of where it was: decoding any of these bombs costs over a gigabyte.

The bombs are built here without allocating them: the PNG is zlib-compressed zero rows fed one
at a time (389 KB), the JPEG is a 16 x 16 JPEG whose SOF header is patched to 20000 x 20000
(335 bytes; libjpeg fills the missing data, so decoding it is as costly as a real one).
"""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import os
import struct
import threading
import zlib
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
from stream_helpers import take_until

from runtime.vision.batch import VisionInputError, VisionJob, decode, prepare_batch
from runtime.vision.config import VisionConfig
from schedulers import Batch
from sources import FileSource, StreamConfig, StreamsSource, load_source
from sources.base import DEFAULT_MAX_IMAGE_PIXELS
from sources.media import ImageTooLarge, NotAnImage, decode_image, image_size, read_image

SIDE = 20000
OVER = f"{SIDE}x{SIDE} = 400.0 Mpx is over the limit of 67.1 Mpx (max_image_pixels)"
BOMB_GROWTH = 200 << 20  # bytes of peak RSS a refused bomb may cost; decoding one costs > 1.2 GB
SAFETY_S = 30


# ---- the bombs ----------------------------------------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_of_zeros(width: int, height: int) -> bytes:
    """A grayscale PNG of zeros, compressed one row at a time: never width x height in memory."""
    z = zlib.compressobj(9)
    row = bytes(width + 1)  # filter byte + pixels
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def jpeg_declaring(width: int, height: int) -> bytes:
    """A tiny JPEG whose frame header (SOF0) says width x height."""
    data = bytearray(cv2.imencode(".jpg", np.zeros((16, 16), np.uint8))[1].tobytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.fixture(scope="module")
def png_bomb() -> bytes:
    data = png_of_zeros(SIDE, SIDE)
    assert len(data) < 400 << 10  # the probe's 389 KB
    return data


@pytest.fixture(scope="module")
def jpeg_bomb() -> bytes:
    data = jpeg_declaring(SIDE, SIDE)
    assert len(data) < 1024
    return data


def small_image(width: int = 64, height: int = 48) -> np.ndarray:
    img = np.zeros((height, width, 3), np.uint8)
    cv2.rectangle(img, (8, 8), (width - 8, height - 8), (0, 200, 255), -1)
    return img


def jpeg_bytes(img: np.ndarray) -> bytes:
    return cv2.imencode(".jpg", img)[1].tobytes()


# ---- memory -------------------------------------------------------------------------------------


def _status_kb(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _reset_peak(pid: int | str) -> None:
    """Reset the peak RSS (VmHWM) of `pid` to its current RSS (Linux >= 4.0)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS of {pid} here ({exc}): the memory bound cannot be measured")


class PeakGrowth:
    """How far the peak RSS of `pid` (this process by default) rose above its RSS at the start
    of the block, in bytes: `growth` once the block is done."""

    def __init__(self, pid: int | str = "self") -> None:
        self.pid = pid
        self.growth: int | None = None

    def __enter__(self) -> PeakGrowth:
        gc.collect()
        _reset_peak(self.pid)
        self._start_kb = _status_kb(self.pid, "VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.growth = (_status_kb(self.pid, "VmHWM") - self._start_kb) << 10

    def check(self) -> None:
        assert self.growth is not None and self.growth < BOMB_GROWTH, (
            f"peak RSS grew by {self.growth / 2**20:.0f} MB (at most {BOMB_GROWTH >> 20} MB)"
        )


def test_the_memory_probe_sees_a_decode_that_was_let_through(png_bomb):
    """The bound the other tests assert is one this measurement can fail: a bomb that is decoded
    (here on purpose, at a limit above it) shows as over a gigabyte of peak growth."""
    with PeakGrowth() as peak:
        image = decode_image(png_bomb, "image", max_pixels=SIDE * SIDE)
        assert image.shape == (SIDE, SIDE, 3)
        del image
    assert peak.growth > 1 << 30


# ---- the header check (sources.media) -------------------------------------------------------------


def test_image_size_reads_the_bombs_headers_without_decoding_them(png_bomb, jpeg_bomb):
    with PeakGrowth() as peak:
        assert image_size(png_bomb) == (SIDE, SIDE)
        assert image_size(jpeg_bomb) == (SIDE, SIDE)
    assert peak.growth < 50 << 20  # a header read: far under BOMB_GROWTH


@pytest.mark.parametrize(
    "ext", ["bmp", "jpg", "jp2", "png", "tif", "webp", "pbm", "pgm", "ppm", "pfm", "sr", "hdr", "gif", "avif"]
)
def test_image_size_agrees_with_what_opencv_decodes_for_every_format_it_writes(ext):
    img = small_image(53, 37)
    src = img.astype(np.float32) / 255 if ext in ("pfm", "hdr") else img[:, :, 0] if ext in ("pbm", "pgm") else img
    try:
        ok, buf = cv2.imencode("." + ext, src)
    except cv2.error:
        pytest.skip(f"this OpenCV build writes no .{ext}")
    assert ok
    data = buf.tobytes()
    assert image_size(data) == (53, 37)
    assert decode_image(data, "image").shape == (37, 53, 3)


@pytest.mark.parametrize("quality", [50, 101])  # lossy (VP8) and lossless (VP8L) WebP
def test_image_size_reads_both_kinds_of_webp(quality):
    data = cv2.imencode(".webp", small_image(53, 37), [cv2.IMWRITE_WEBP_QUALITY, quality])[1].tobytes()
    assert image_size(data) == (53, 37)


def test_bytes_in_no_image_format_are_refused_not_decoded_blind():
    for data in (b"hello world", b"\xff\xd8 definitely not a jpeg", b"<svg></svg>"):
        with pytest.raises(NotAnImage, match=r"^image: not an image format this server decodes \(JPEG, PNG"):
            decode_image(data, "image")
    with pytest.raises(NotAnImage, match="^url: not a readable PNG image: its header is corrupt"):
        decode_image(b"\x89PNG\r\n\x1a\n" + b"\x00" * 8, "url")
    with pytest.raises(NotAnImage, match="^image: the image is empty"):
        decode_image(b"", "image")


def test_decode_image_refuses_the_bombs_naming_the_field_and_the_limit(png_bomb, jpeg_bomb):
    with PeakGrowth() as peak:
        for data in (png_bomb, jpeg_bomb):
            with pytest.raises(ImageTooLarge) as exc:
                decode_image(data, "image")
            assert str(exc.value) == f"image: {OVER}"
            assert isinstance(exc.value, ValueError)  # a caller's input: 400 / invalid_request
    peak.check()


def _tiled_tiff(side: int, tile: int) -> bytes:
    """A side x side RGB TIFF whose one tile is tile x tile (deflate-compressed zeros: tiny on disk)."""
    data = zlib.compress(bytes(tile * tile * 3), 9)
    tags = [
        (256, 4, 1, side),
        (257, 4, 1, side),
        (258, 3, 3, None),
        (259, 3, 1, 8),
        (262, 3, 1, 2),
        (277, 3, 1, 3),
        (284, 3, 1, 1),
        (322, 4, 1, tile),
        (323, 4, 1, tile),
        (324, 4, 1, None),
        (325, 4, 1, len(data)),
    ]
    ifd_size = 2 + len(tags) * 12 + 4
    bps_at = 8 + ifd_size
    tile_at = bps_at + 6
    ifd = struct.pack("<H", len(tags))
    for tag, kind, count, value in tags:
        value = {258: bps_at, 324: tile_at}.get(tag, value)
        packed = struct.pack("<HH", value, 0) if kind == 3 and count == 1 else struct.pack("<I", value)
        ifd += struct.pack("<HHI", tag, kind, count) + packed
    return b"II*\x00" + struct.pack("<I", 8) + ifd + struct.pack("<I", 0) + struct.pack("<HHH", 8, 8, 8) + data


def test_a_tiff_whose_tiles_are_larger_than_its_image_is_sized_by_its_tiles():
    """A 1 x 1 image with 14000 x 14000 tiles: OpenCV allocates the whole tile (750 MB) though
    the image has one pixel, so the tile is what the limit checks."""
    bomb = _tiled_tiff(1, 14000)
    assert len(bomb) < 1 << 20 and image_size(bomb) == (14000, 14000)
    with PeakGrowth() as peak:
        with pytest.raises(ImageTooLarge, match=r"^image: 14000x14000 = 196.0 Mpx is over the limit of 67.1 Mpx"):
            decode_image(bomb, "image")
    peak.check()
    ok = decode_image(_tiled_tiff(32, 32), "image")  # tiles no larger than the image decode as before
    assert ok.shape == (32, 32, 3)


def test_a_header_that_pillows_own_bomb_check_refuses_is_refused_naming_the_limit(monkeypatch, png_bomb):
    from PIL import Image

    def refusing(fp, filename):  # what a plugin that runs Pillow's check at open raises
        raise Image.DecompressionBombError("Image size (400000000 pixels) exceeds limit of 178956970 pixels, ...")

    Image.preinit()
    monkeypatch.setitem(Image.OPEN, "PNG", (refusing, Image.OPEN["PNG"][1]))
    with pytest.raises(
        ImageTooLarge,
        match=r"^image: 400.0 Mpx \(a PNG header\), over Pillow's decompression-bomb "
        r"limit of 179.0 Mpx; the limit is 67.1 Mpx \(max_image_pixels\)$",
    ):
        decode_image(png_bomb, "image")


def test_the_limit_is_exact_and_can_be_raised_or_lowered():
    data = jpeg_bytes(small_image(64, 48))
    assert decode_image(data, "image", max_pixels=64 * 48).shape == (48, 64, 3)
    with pytest.raises(ImageTooLarge, match=r"^frame: 64x48 = 0.0 Mpx is over the limit of 0.0 Mpx"):
        decode_image(data, "frame", max_pixels=64 * 48 - 1)
    assert DEFAULT_MAX_IMAGE_PIXELS == 8192 * 8192


# ---- files, directories, videos (load_source) ----------------------------------------------------


def test_read_image_refuses_a_bomb_file_naming_it_and_the_limit(tmp_path, png_bomb):
    path = tmp_path / "bomb.png"
    path.write_bytes(png_bomb)
    with PeakGrowth() as peak:
        image, error = read_image(str(path))
    peak.check()
    assert image is None and error == f"image {path}: {OVER}"


def test_a_directory_with_a_bomb_yields_its_error_record_and_the_other_images(tmp_path, png_bomb, jpeg_bomb):
    (tmp_path / "a_bomb.png").write_bytes(png_bomb)
    (tmp_path / "b_bomb.jpg").write_bytes(jpeg_bomb)
    cv2.imwrite(str(tmp_path / "c_normal.jpg"), small_image())
    with PeakGrowth() as peak:
        frames = list(load_source(str(tmp_path)))
    peak.check()
    by_name = {os.path.basename(f.source): f for f in frames}
    assert sorted(by_name) == ["a_bomb.png", "b_bomb.jpg", "c_normal.jpg"]
    for name in ("a_bomb.png", "b_bomb.jpg"):
        assert by_name[name].image is None and by_name[name].error.endswith(OVER)
    assert by_name["c_normal.jpg"].ok and by_name["c_normal.jpg"].image.shape == (48, 64, 3)


def test_lists_of_paths_and_of_arrays_take_the_limit_given_to_load_source(tmp_path):
    path = tmp_path / "normal.jpg"
    cv2.imwrite(str(path), small_image(64, 48))
    (frame,) = load_source([str(path)], max_image_pixels=64 * 48 - 1)
    assert frame.error == f"image {path}: 64x48 = 0.0 Mpx is over the limit of 0.0 Mpx (max_image_pixels)"
    (frame,) = load_source([str(path)], max_image_pixels=64 * 48)
    assert frame.ok
    arrays = list(load_source([small_image(64, 48), small_image(32, 24)], max_image_pixels=64 * 48 - 1))
    assert "array:0: 64x48" in arrays[0].error and "max_image_pixels" in arrays[0].error and arrays[1].ok


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("video") / "clip.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
    for i in range(5):
        writer.write(np.full((48, 64, 3), 40 * i, np.uint8))
    writer.release()
    return path


_VideoCapture = cv2.VideoCapture


class CountingCapture:
    """cv2.VideoCapture that counts the frames read from it (all instances together)."""

    reads = 0

    def __init__(self, *args):
        self._cap = _VideoCapture(*args)

    def read(self):
        CountingCapture.reads += 1
        return self._cap.read()

    def __getattr__(self, name):
        return getattr(self._cap, name)


def test_a_video_over_the_limit_is_one_error_frame_before_any_frame_is_read(video, monkeypatch):
    import sources.media

    monkeypatch.setattr(sources.media.cv2, "VideoCapture", CountingCapture)
    CountingCapture.reads = 0
    (frame,) = list(FileSource(str(video), max_image_pixels=64 * 48 - 1))
    assert frame.error == f"video {video}: 64x48 = 0.0 Mpx is over the limit of 0.0 Mpx (max_image_pixels)"
    assert CountingCapture.reads == 0
    frames = list(FileSource(str(video)))
    assert len(frames) == 5 and all(f.ok for f in frames) and CountingCapture.reads > 0


def avi_declaring(path: Path, side: int) -> Path:
    """A 3-frame MJPEG AVI of 64 x 48, patched to say side x side: in its headers (avih, strf)
    and in every frame's SOF. A few KB; FFmpeg reports the patched size once it is opened."""
    small = path.with_suffix(".small.avi")
    writer = cv2.VideoWriter(str(small), cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
    for i in range(3):
        writer.write(np.full((48, 64, 3), 50 * i, np.uint8))
    writer.release()
    data = bytearray(small.read_bytes())
    at = data.find(b"\xff\xc0")
    while at >= 0:
        if data[at + 2 : at + 4] == b"\x00\x11":  # a baseline SOF of 3 components
            data[at + 5 : at + 9] = struct.pack(">HH", side, side)
        at = data.find(b"\xff\xc0", at + 2)
    avih, strf = data.find(b"avih") + 8, data.find(b"strf") + 8
    data[avih + 32 : avih + 40] = struct.pack("<II", side, side)  # dwWidth, dwHeight
    data[strf + 4 : strf + 12] = struct.pack("<ii", side, side)  # biWidth, biHeight
    path.write_bytes(bytes(data))
    return path


def test_a_video_file_declaring_16000x16000_is_refused_once_opened_before_any_read(tmp_path, monkeypatch):
    import sources.media

    # 16000 x 16000 (256 Mpx), not 20000: FFmpeg itself refuses frames over about 268 Mpx.
    path = avi_declaring(tmp_path / "bomb.avi", 16000)
    monkeypatch.setattr(sources.media.cv2, "VideoCapture", CountingCapture)
    CountingCapture.reads = 0
    with PeakGrowth() as peak:
        frames = list(load_source(str(path)))
    peak.check()
    assert CountingCapture.reads == 0
    assert [f.error for f in frames] == [
        f"video {path}: 16000x16000 = 256.0 Mpx is over the limit of 67.1 Mpx (max_image_pixels)"
    ]


# ---- streams: MJPEG parts and captures -------------------------------------------------------------


class PartsServer:
    """A loopback MJPEG camera that sends `parts` (encoded bytes, as they are) once per
    connection, then holds the connection open until closed."""

    def __init__(self, parts: list[bytes]) -> None:
        stop = self._stop = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=part")
                self.end_headers()
                try:
                    for data in parts:
                        head = f"--part\r\nContent-Type: image/jpeg\r\nContent-Length: {len(data)}\r\n\r\n"
                        self.wfile.write(head.encode() + data + b"\r\n")
                    self.wfile.flush()
                    stop.wait(SAFETY_S)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/stream.mjpg"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


@contextlib.contextmanager
def camera(parts: list[bytes]):
    server = PartsServer(parts)
    try:
        yield server.url
    finally:
        server.close()


FAST = dict(open_timeout_s=2.0, read_timeout_s=5.0, backoff_initial_s=0.05, backoff_max_s=0.1)


def test_an_mjpeg_part_over_the_limit_is_refused_from_its_header(jpeg_bomb):
    normal = jpeg_bytes(small_image())
    with camera([normal, jpeg_bomb]) as url, PeakGrowth() as peak:
        with StreamsSource(url, StreamConfig(buffer=4, max_retries=0, **FAST)) as src:
            frames = take_until(src, lambda fs: any(not f.ok for f in fs), SAFETY_S)
    peak.check()
    good = [f for f in frames if f.ok]
    (error,) = [f for f in frames if not f.ok]
    assert len(good) == 1 and good[0].image.shape == (48, 64, 3)  # the camera's frames before it
    assert f"MJPEG part ({len(jpeg_bomb)} bytes): {OVER}" in error.error and "ImageTooLarge" in error.error


def test_a_stream_whose_capture_reports_too_large_a_size_goes_down_before_reading(video):
    config = StreamConfig(max_retries=0, max_image_pixels=64 * 48 - 1, **FAST)
    with StreamsSource([str(video)], config) as src:
        frames = take_until(src, lambda fs: any(not f.ok for f in fs), SAFETY_S)
        health = src.health()[0]
    assert all(not f.ok for f in frames) and health.frames_read == 0
    assert "64x48 = 0.0 Mpx is over the limit of 0.0 Mpx (max_image_pixels)" in frames[0].error


def test_stream_config_and_vision_config_check_the_limit():
    assert StreamConfig().max_image_pixels == VisionConfig().max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS
    for bad in (0, -1, 1.5, True, "big"):
        with pytest.raises(ValueError, match="max_image_pixels must be an integer >= 1"):
            StreamConfig(max_image_pixels=bad)
        with pytest.raises(ValueError, match="max_image_pixels must be an integer >= 1"):
            VisionConfig(max_image_pixels=bad)
    assert VisionConfig.from_dict({"max_image_pixels": 1000}).max_image_pixels == 1000


# ---- the camera service and `tandem streams --max-image-pixels` -------------------------------------


class Det:
    """What a detection result gives a record."""

    batch_size = 1

    def __len__(self) -> int:
        return 0

    def to_dict(self) -> dict:
        return {"boxes": [], "conf": [], "cls": [], "names": []}


class FakeRuntime:
    """A Runtime stand-in with a vision config: submit_detect decodes as the real batch does (with
    the config's limit) and answers at once, counting what it was given."""

    def __init__(self, config: VisionConfig | None = None) -> None:
        self.vision = SimpleNamespace(config=config or VisionConfig())
        self.submitted: list = []

    def submit_detect(self, item, priority: int = 0, deadline_s=None, request_id=None) -> Future:
        self.submitted.append(item)
        future: Future = Future()
        try:
            decode(item, self.vision.config.max_image_pixels)
            future.set_result(Det())
        except VisionInputError as exc:
            future.set_exception(exc)
        return future

    def metrics_snapshot(self) -> dict:
        return {}

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        pass


class Lines:
    """A jsonl sink that wakes a waiter on each record."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.cond = threading.Condition()

    def write(self, text: str) -> None:
        with self.cond:
            self.records += [json.loads(line) for line in text.splitlines() if line]
            self.cond.notify_all()

    def flush(self) -> None:
        pass

    def wait(self, predicate, timeout: float = SAFETY_S) -> list[dict]:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.records), timeout), f"records: {self.records}"
            return list(self.records)


def test_the_camera_service_refuses_a_bomb_frame_at_its_runtimes_limit(jpeg_bomb):
    from workers.cameras import CameraService, camera_policy

    rt = FakeRuntime(VisionConfig(max_image_pixels=640 * 480))
    lines = Lines()
    with camera([jpeg_bytes(small_image()), jpeg_bomb]) as url, PeakGrowth() as peak:
        with CameraService(
            rt, None, jsonl=lines, url_policy=camera_policy(allowed_networks=("127.0.0.1/32",))
        ) as service:
            assert service.stream_config.max_image_pixels == 640 * 480  # the Runtime's, not a second knob
            service.add("door", url)
            records = lines.wait(lambda rs: any(r["error"] for r in rs))
    peak.check()
    down = [r for r in records if r["error"]]
    assert down[0]["camera"] == "door" and down[0]["frame"] is None
    # A remotely added camera's record names the limit, not the frame's size (what the target
    # sent: workers/cameras_security.public_error); the log keeps the whole text.
    assert down[0]["error"] == "frame too large: over the limit of 0.3 Mpx (max_image_pixels)", down[0]["error"]
    assert all(isinstance(item.image, np.ndarray) and item.image.shape == (48, 64, 3) for item in rt.submitted)


def test_tandem_streams_max_image_pixels_reaches_the_runtime_and_the_readers():
    import argparse

    from tandem.streams_cli import _plan, add_streams_arguments
    from workers.cameras import CameraService

    parser = argparse.ArgumentParser()
    add_streams_arguments(parser)
    base = ["http://127.0.0.1:9/cam", "--no-redis", "--jsonl", "-", "--no-auth"]
    _, vision, _ = _plan(parser.parse_args([*base, "--max-image-pixels", "5000"]))
    assert vision["max_image_pixels"] == 5000
    config = VisionConfig.from_dict(vision)  # what Runtime(vision=vision) builds
    with CameraService(FakeRuntime(config), None, jsonl=Lines()) as service:
        assert service.stream_config.max_image_pixels == 5000
    _, vision, _ = _plan(parser.parse_args(base))
    assert VisionConfig.from_dict(vision).max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS
    with pytest.raises(ValueError, match="--max-image-pixels must be an integer >= 1"):
        _plan(parser.parse_args([*base, "--max-image-pixels", "0"]))


# ---- the engine's batch decode --------------------------------------------------------------------


class StandInRunner:
    """What prepare_batch needs of a YoloRunner: its config and prepare()."""

    def __init__(self, config: VisionConfig) -> None:
        self.config = config
        self.prepared: list = []

    def prepare(self, images):
        self.prepared = list(images)
        return images


def _prepare(runner, payloads: list) -> dict[str, Future]:
    jobs = {f"r{i}": VisionJob(Future(), 0.0) for i in range(len(payloads))}
    prepare_batch(runner, Batch(list(jobs), payloads), jobs, 0.0)
    return {rid: job.future for rid, job in jobs.items()}


def test_the_engines_batch_refuses_a_bomb_path_at_its_configured_limit(tmp_path, png_bomb):
    bomb, normal = tmp_path / "bomb.png", tmp_path / "normal.jpg"
    bomb.write_bytes(png_bomb)
    cv2.imwrite(str(normal), small_image(64, 48))
    runner = StandInRunner(VisionConfig())
    with PeakGrowth() as peak:
        futures = _prepare(runner, [str(bomb), str(normal)])
    peak.check()
    with pytest.raises(VisionInputError, match=OVER.replace("(", r"\(").replace(")", r"\)")):
        futures["r0"].result(0)
    assert [im.shape for im in runner.prepared] == [(48, 64, 3)]  # the other input of the batch goes on
    lowered = StandInRunner(VisionConfig(max_image_pixels=64 * 48 - 1))
    futures = _prepare(lowered, [str(normal), small_image(64, 48), small_image(32, 24)])
    for rid in ("r0", "r1"):
        with pytest.raises(VisionInputError, match=r"64x48 = 0.0 Mpx is over the limit of 0.0 Mpx"):
            futures[rid].result(0)
    assert [im.shape for im in lowered.prepared] == [(24, 32, 3)]


# ---- the worker's tandem.detect job ---------------------------------------------------------------


class BytesServer:
    """A loopback HTTP server answering every GET with `data` as image/png."""

    def __init__(self, data: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.prefix = f"http://127.0.0.1:{self._httpd.server_address[1]}/"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture(scope="module")
def bomb_url(png_bomb):
    server = BytesServer(png_bomb)
    yield server.prefix + "bomb.png"
    server.close()


def _host(rt: FakeRuntime, url_prefix: str = "http://127.0.0.1/") -> SimpleNamespace:
    from workers.settings import JobSettings

    return SimpleNamespace(runtime=rt, settings=JobSettings(allowed_url_prefixes=(url_prefix,)))


JOB = SimpleNamespace(job_id="job-1", attach=lambda work: None, fenced=False, submitted_at=0.0)


def test_the_worker_job_refuses_a_bomb_upload_and_url_before_decoding(png_bomb, bomb_url, monkeypatch):
    from workers.jobs import detect_body

    monkeypatch.setenv("TANDEM_ALLOWED_URL_NETWORKS", "127.0.0.1/32")  # the bomb is served on loopback

    rt = FakeRuntime()
    host = _host(rt, bomb_url.rsplit("/", 1)[0] + "/")
    with PeakGrowth() as peak:
        with pytest.raises(ValueError) as upload:
            detect_body(host, JOB, {"image": base64.b64encode(png_bomb).decode()})
        with pytest.raises(ValueError) as fetched:
            detect_body(host, JOB, {"url": bomb_url})
    peak.check()
    assert str(upload.value) == f"image: {OVER}" and str(fetched.value) == f"url: {OVER}"
    assert rt.submitted == []  # nothing reached the Runtime
    result, _ = detect_body(host, JOB, {"image": base64.b64encode(jpeg_bytes(small_image())).decode()})
    assert result["error"] is None and rt.submitted[0].shape == (48, 64, 3)


def test_the_worker_job_uses_its_runtimes_limit():
    from workers.jobs import detect_body

    rt = FakeRuntime(VisionConfig(max_image_pixels=64 * 48 - 1))
    with pytest.raises(ValueError, match=r"^image: 64x48 = 0.0 Mpx is over the limit of 0.0 Mpx"):
        detect_body(_host(rt), JOB, {"image": base64.b64encode(jpeg_bytes(small_image(64, 48))).decode()})
    with pytest.raises(ValueError, match="^image: not an image format this server decodes"):
        detect_body(_host(rt), JOB, {"image": base64.b64encode(b"GIF? no").decode()})
    assert rt.submitted == []


# ---- POST /v1/detect -------------------------------------------------------------------------------


def _server(name: str):
    """The HTTP server's module `name` (server/)."""
    import importlib

    return importlib.import_module(f"server.{name}")


@pytest.fixture
def embedded_client():
    from fastapi.testclient import TestClient

    rt = FakeRuntime()
    with TestClient(_server("app").create_app(_server("embedded").EmbeddedBackend(rt, "none"))) as client:
        yield client, rt


def test_http_detect_answers_400_to_a_bomb_as_raw_body_upload_and_base64(embedded_client, png_bomb):
    client, rt = embedded_client
    with PeakGrowth() as peak:
        answers = [
            client.post("/v1/detect", content=png_bomb, headers={"Content-Type": "image/png"}),
            client.post("/v1/detect", files={"file": ("bomb.png", png_bomb, "image/png")}),
            client.post("/v1/detect", json={"image": base64.b64encode(png_bomb).decode()}),
        ]
    peak.check()
    for r in answers:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == f"image: {OVER}" and r.json()["error"]["param"] == "image"
    assert rt.submitted == []
    ok = client.post("/v1/detect", content=jpeg_bytes(small_image()), headers={"Content-Type": "image/jpeg"})
    assert ok.status_code == 200 and ok.json()["error"] is None, ok.text


@pytest.mark.slow
def test_http_detect_over_a_real_worker_refuses_the_bomb_and_the_worker_stays_small(shared_fleet, png_bomb):
    """The probe's setup: the server's app over Redis (the jobs backend, in this process) and a
    real `tandem worker` on the vision queue, which decodes: the session's shared one
    (tests/fleet_support.py: YOLO26n at imgsz 160, batch 1, beside the tiny Llama, idle between
    tests). The raw-body bomb gets a 400 naming the limit, and the worker's peak RSS barely
    moves (the probe saw it go from 3.0 to 5.3 GB)."""
    from fastapi.testclient import TestClient

    fleet = shared_fleet.ready()
    worker = fleet.worker
    app_module, backends = _server("app"), _server("backends")
    normal = jpeg_bytes(small_image())
    app = app_module.create_app(backends.JobsBackend(fleet.settings), app_module.ServeConfig(request_timeout_s=60))
    with TestClient(app) as client:
        warm = client.post("/v1/detect", content=normal, headers={"Content-Type": "image/jpeg"})
        assert warm.status_code == 200, warm.text  # the model has run once: its memory is in the baseline
        with PeakGrowth(worker.proc.pid) as peak:
            r = client.post("/v1/detect", content=png_bomb, headers={"Content-Type": "image/png"})
        peak.check()
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == f"image: {OVER}" and r.json()["error"]["param"] == "image"
        after = client.post("/v1/detect", content=normal, headers={"Content-Type": "image/jpeg"})
        assert after.status_code == 200 and after.json()["error"] is None  # the worker serves on
    assert worker.proc.poll() is None


def test_http_reads_no_image_format_as_a_400_too(embedded_client):
    client, rt = embedded_client
    r = client.post("/v1/detect", content=b"not an image at all", headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "not an image format" in r.json()["error"]["message"]
    assert rt.submitted == []
