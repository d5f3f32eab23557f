"""`tandem detect SOURCE`: YOLO detection on any source, one JSON line per input frame.

    tandem detect bus.jpg
    tandem detect images/ --save out/ --imgsz 320
    tandem detect cams.streams --max-frames 100
    tandem detect clip.mp4 --classes 0,2 --nms --track bytetrack

stdout carries only the JSON lines, each printed as soon as its frame is done (pipe them
anywhere); the progress bar, the model note, the summary and errors that stop the run go to
stderr. Exit codes: 0 every input succeeded, 1 every input failed, 2 bad arguments or a
source that cannot start, 3 some inputs failed (their lines carry the error), 130
interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future

from runtime.vision.detector import WEIGHTS, default_imgsz
from runtime.vision.flags import (
    add_backend_argument,
    add_max_image_pixels_argument,
    max_image_pixels_option,
    parse_class_ids,
)
from runtime.vision.records import detection_record

EXIT_OK, EXIT_ALL_FAILED, EXIT_USAGE, EXIT_SOME_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
_IDLE_S = 0.05  # how often a stream run with nothing arriving prints the results that are done


def add_detect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", help="image, directory, glob, .txt list, video, .streams file, stream URL or webcam index"
    )
    parser.add_argument(
        "--model",
        default=str(WEIGHTS),
        help="a local .pt checkpoint or a model .yaml (random weights); nothing is downloaded "
        "(default: the shipped shapes detector, runtime/vision/detector.py)",
    )
    parser.add_argument(
        "--imgsz",
        type=int,
        default=None,
        help="letterbox size, a multiple of 32 (default: the shipped detector's 320, else 640)",
    )
    parser.add_argument("--conf", type=float, default=0.25, help="confidence threshold")
    parser.add_argument(
        "--iou",
        type=float,
        default=0.7,
        help="NMS IoU threshold; an end-to-end head (YOLO26, YOLOv10: the default where the model has one) "
        "runs no NMS, so it applies only with --nms or to other heads",
    )
    parser.add_argument(
        "--nms",
        action="store_true",
        help="use the one-to-many head with NMS at --iou instead of the end-to-end head (Ultralytics' "
        "end2end=False). On the shipped detector the end-to-end head often puts two near-identical boxes "
        "on one object, and this scores higher: mAP50-95 0.8065 against 0.7830 (runtime/vision/postprocess.py)",
    )
    parser.add_argument(
        "--classes",
        type=class_ids,
        default=None,
        metavar="0,2",
        help="keep only these class ids, comma-separated (default: every class)",
    )
    parser.add_argument("--max-batch-size", type=int, default=8, help="most frames in one forward pass")
    parser.add_argument(
        "--max-queue-delay-ms", type=float, default=5.0, help="how long a frame may wait for others to fill its batch"
    )
    parser.add_argument("--vid-stride", type=int, default=1, help="run every n-th video frame")
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda if available, as tandem generate)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto (default): bfloat16 on CPUs with native bf16 (AMX/AVX512-BF16), float16 on "
        "CUDA, else float32; measured within 0.5 mAP of float32 on the shipped detector. "
        "float32 matches Ultralytics exactly; validate a fast dtype on your own weights",
    )
    parser.add_argument(
        "--max-frames",
        type=int,
        default=None,
        help="stop after this many output lines, error lines included (for streams)",
    )
    parser.add_argument(
        "--save",
        metavar="DIR",
        default=None,
        help="write annotated images / videos to DIR, or to DIR2, DIR3, ... if DIR holds files",
    )
    parser.add_argument(
        "--stream-buffer", type=int, default=0, help="0: newest frame per stream only; n: a FIFO of n frames per stream"
    )
    parser.add_argument(
        "--stream-retries",
        type=int,
        default=3,
        help="reconnects a stream gets after it goes down before it counts as dead (-1: forever); "
        "a run whose streams are all dead or ended stops",
    )
    parser.add_argument(
        "--track",
        choices=("bytetrack", "botsort"),
        default=None,
        help='give each line of a video or stream a "track_ids" list (one id per box, null where a box '
        "has no confirmed track yet) from Ultralytics' tracker of that name; one tracker per source",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the start-up batch-size profiling")
    add_max_image_pixels_argument(parser)
    add_backend_argument(parser)


def class_ids(text: str) -> tuple[int, ...]:
    """`--classes 0,2` -> (0, 2), as an argparse type."""
    try:
        return parse_class_ids(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--classes").lstrip(": ")) from None


def quiet_opencv() -> None:
    """OpenCV logs every failed open of a camera or stream itself, several lines each time;
    the error lines already say what failed, once. (The CLI's choice: the library leaves
    OpenCV's logging alone.)"""
    import cv2

    try:
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
    except AttributeError:  # an OpenCV build without the logging module
        pass


def detect_config(args: argparse.Namespace):
    """The VisionConfig `tandem detect` runs with these flags (ValueError naming a bad one).
    `python -m benchmarks vision` builds its "default flags" row with it."""
    from runtime.devices import checked_device
    from runtime.vision.config import VisionConfig, vision_batching

    device = checked_device("--device", args.device)
    batching = vision_batching(max_batch_size=args.max_batch_size, max_queue_delay_ms=args.max_queue_delay_ms)
    return VisionConfig(
        model=args.model,
        imgsz=args.imgsz or default_imgsz(args.model),
        conf=args.conf,
        iou=args.iou,
        end2end=False if args.nms else None,
        classes=args.classes,
        backend=args.backend,
        device=device,
        dtype=args.dtype,
        batching=batching,
        profile=not args.no_profile,
        **max_image_pixels_option(args),
    )


def run_detect(args: argparse.Namespace) -> int:
    from sources import SourceError, StreamConfig, load_source

    try:
        config = detect_config(args)
        if args.track:
            from runtime.vision.tracking import missing_dependency

            problem = missing_dependency()
            if problem:
                raise ValueError(f"--track: {problem}")
        if args.max_frames is not None and args.max_frames < 1:
            raise ValueError(f"--max-frames must be >= 1, got {args.max_frames}")
        if args.stream_retries < -1:
            raise ValueError(f"--stream-retries must be >= 0, or -1 for forever, got {args.stream_retries}")
        stream_config = StreamConfig(
            buffer=args.stream_buffer, max_retries=None if args.stream_retries == -1 else args.stream_retries
        )
        # Streams start reading once the model is ready: frames read before would be dropped.
        source = load_source(
            args.source,
            vid_stride=args.vid_stride,
            stream_config=stream_config,
            start_streams=False,
            max_image_pixels=config.max_image_pixels,
        )
    except (ValueError, SourceError) as exc:
        print(f"tandem detect: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    quiet_opencv()
    try:
        return _detect(args, config, source)
    except KeyboardInterrupt:
        print("tandem detect: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        source.close()


def _frames(source) -> Iterator[object]:
    """The source's frames, with a None whenever a live source has had nothing for _IDLE_S, so
    the caller can print finished results while it waits for frames."""
    if not hasattr(source, "next_batch"):
        yield from source
        return
    source.start()
    while True:
        batch = source.next_batch(timeout=_IDLE_S)
        if not batch:
            if source.finished:
                return
            yield None
        yield from batch


class SourceTrackers:
    """`--track`: a tracker per video or stream, fed its frames in order (lines are emitted in
    input order, and each source's frames arrive in order)."""

    def __init__(self, kind: str, vid_stride: int) -> None:
        self.kind, self.vid_stride = kind, vid_stride
        self._trackers: dict[tuple[str, int | None], object] = {}

    def track_ids(self, frame, det) -> list[int | None] | None:
        """The ids of det's boxes; None for a still image (nothing to follow) or a failed frame."""
        from runtime.vision.annotate import video_fps
        from runtime.vision.tracking import make_tracker
        from sources.base import VIDEO_EXTENSIONS, extension

        is_video = frame.stream is None and extension(frame.source) in VIDEO_EXTENSIONS
        if det is None or not (is_video or frame.stream is not None):
            return None
        key = (frame.source, frame.stream)
        tracker = self._trackers.get(key)
        if tracker is None:
            # A video's rate sets how many frames a lost track is kept (about a second's worth).
            fps = (video_fps(frame.source) or 30.0) / self.vid_stride if is_video else 30.0
            tracker = self._trackers[key] = make_tracker(self.kind, fps)
        return tracker.update(det, frame.image)


def exit_code(num_ok: int, num_failed: int) -> int:
    if num_failed == 0:
        return EXIT_OK
    return EXIT_ALL_FAILED if num_ok == 0 else EXIT_SOME_FAILED


def _detect(args: argparse.Namespace, config, source) -> int:
    from tqdm import tqdm

    from runtime.vision.annotate import AnnotatedWriter, numbered_dir
    from runtime.vision.engine import VisionEngine
    from schedulers import QueueFullError

    try:
        engine = VisionEngine(config)
    except (OSError, ValueError) as exc:
        print(f"tandem detect: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    preferred = list(engine.preferred_batch_sizes) or "none (max_batch_size or max_queue_delay_ms releases)"
    print(f"tandem detect: model {engine.runner.description}; preferred batch sizes {preferred}", file=sys.stderr)
    print(f"tandem detect: {engine.startup_line()}", file=sys.stderr)
    finite = source.total is not None or source.kind != "streams"
    bar = tqdm(total=source.total, unit="frame", file=sys.stderr, disable=not finite)
    writer = AnnotatedWriter(numbered_dir(args.save), vid_stride=args.vid_stride) if args.save else None
    window: deque[tuple[object, Future | None]] = deque()
    limit = 4 * config.batching.max_batch_size  # frames in flight: enough to fill batches, bounded memory
    counts = {"ok": 0, "failed": 0}
    trackers = SourceTrackers(args.track, args.vid_stride) if args.track else None

    def emit_oldest() -> None:
        frame, future = window.popleft()
        det, error = None, frame.error
        if future is not None:
            try:
                det = future.result()
            except Exception as exc:  # noqa: BLE001 - the error belongs to this input's line
                error = str(exc)
            else:
                if writer is not None:
                    writer.write(frame, det)
        counts["failed" if error else "ok"] += 1
        record = detection_record(frame.source, frame.index, det, error)
        if trackers is not None:
            record["track_ids"] = trackers.track_ids(frame, det)
        print(json.dumps(record), flush=True)
        bar.update(1)

    def emit_done() -> None:
        # In input order: a line waits only for the frames before it, never for a full window.
        while window and (window[0][1] is None or window[0][1].done()):
            emit_oldest()

    try:
        for frame in _frames(source):
            if frame is not None:
                if args.max_frames is not None and sum(counts.values()) + len(window) >= args.max_frames:
                    break
                future = None
                if frame.error is None:
                    while True:
                        try:
                            future = engine.submit(frame)
                            break
                        except QueueFullError:
                            emit_oldest()
                window.append((frame, future))
                while len(window) > limit:
                    emit_oldest()
            emit_done()
        while window:
            emit_oldest()
    finally:
        bar.close()
        engine.close(drain=False)
        if writer is not None:
            writer.close()
    ok, failed = counts["ok"], counts["failed"]
    saved = f"; annotated output in {writer.directory}" if writer is not None else ""
    print(f"tandem detect: {ok + failed} frames, {ok} ok, {failed} failed{saved}", file=sys.stderr)
    return exit_code(ok, failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem detect", description=__doc__.split("\n\n")[0])
    add_detect_arguments(parser)
    return run_detect(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
