"""`tandem detect SOURCE`: YOLO detection on any source, one JSON line per input frame.

    tandem detect bus.jpg
    tandem detect images/ --save out/ --imgsz 320
    tandem detect cams.streams --max-frames 100

stdout carries only the JSON lines (pipe them anywhere); the progress bar, the model note
and errors that stop the run go to stderr. Exit codes: 0 the run completed (per-input
errors are in the lines), 1 every input failed, 2 bad arguments or a source that cannot
start, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from concurrent.futures import Future


def add_detect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="image, directory, glob, .txt list, video, .streams file, stream URL or webcam index")
    parser.add_argument("--model", default="yolo26n.yaml", help="model .yaml (random weights) or .pt checkpoint")
    parser.add_argument("--imgsz", type=int, default=640, help="letterbox size, a multiple of 32")
    parser.add_argument("--conf", type=float, default=0.25, help="confidence threshold")
    parser.add_argument("--iou", type=float, default=0.7, help="NMS IoU threshold (non end-to-end heads)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-queue-delay-ms", type=float, default=5.0)
    parser.add_argument("--vid-stride", type=int, default=1, help="run every n-th video frame")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="float32 matches Ultralytics; bfloat16 (CPU with AMX/AVX512-BF16) is faster "
                             "but its boxes can differ: validate it on your weights")
    parser.add_argument("--max-frames", type=int, default=None,
                        help="stop after this many input frames, error entries included (for streams)")
    parser.add_argument("--save", metavar="DIR", default=None, help="write annotated images / videos here")
    parser.add_argument("--stream-buffer", type=int, default=0,
                        help="0: newest frame per stream only; n: a FIFO of n frames per stream")
    parser.add_argument("--no-profile", action="store_true", help="skip the start-up batch-size profiling")


def _line(frame, det=None, error: str | None = None) -> str:
    out = {"source": frame.source, "frame": frame.index}
    if det is not None:
        out.update(det.to_dict())
    else:
        out.update({"boxes": [], "conf": [], "cls": [], "names": []})
    out["error"] = error
    return json.dumps(out)


def run_detect(args: argparse.Namespace) -> int:
    from runtime.vision.config import VisionConfig, vision_batching
    from sources import SourceError, StreamConfig, load_source

    try:
        batching = vision_batching(max_batch_size=args.max_batch_size, max_queue_delay_ms=args.max_queue_delay_ms)
        config = VisionConfig(
            model=args.model, imgsz=args.imgsz, conf=args.conf, iou=args.iou, device=args.device,
            dtype=args.dtype, batching=batching, profile=not args.no_profile,
        )
        if args.max_frames is not None and args.max_frames < 1:
            raise ValueError(f"--max-frames must be >= 1, got {args.max_frames}")
        source = load_source(args.source, vid_stride=args.vid_stride, stream_config=StreamConfig(buffer=args.stream_buffer))
    except (ValueError, SourceError) as exc:
        print(f"tandem detect: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _detect(args, config, source)
    except KeyboardInterrupt:
        print("tandem detect: interrupted", file=sys.stderr)
        return 130
    finally:
        source.close()


def _detect(args: argparse.Namespace, config, source) -> int:
    from tqdm import tqdm

    from runtime.vision.annotate import AnnotatedWriter
    from runtime.vision.engine import VisionEngine
    from schedulers import QueueFullError

    try:
        engine = VisionEngine(config)
    except (OSError, ValueError) as exc:
        print(f"tandem detect: error: {exc}", file=sys.stderr)
        return 2
    preferred = list(engine.preferred_batch_sizes) or "none (max_batch_size or max_queue_delay_ms releases)"
    print(f"tandem detect: model {engine.runner.description}; preferred batch sizes {preferred}", file=sys.stderr)
    finite = source.total is not None or source.kind != "streams"
    bar = tqdm(total=source.total, unit="frame", file=sys.stderr, disable=not finite)
    writer = AnnotatedWriter(args.save) if args.save else None
    window: deque[tuple[object, Future | None]] = deque()
    limit = 4 * config.batching.max_batch_size  # frames in flight: enough to fill batches, bounded memory
    emitted = ok = 0

    def emit_oldest() -> None:
        nonlocal emitted, ok
        frame, future = window.popleft()
        if future is None:
            line = _line(frame, error=frame.error)
        else:
            try:
                det = future.result()
            except Exception as exc:  # noqa: BLE001 - the error belongs to this input's line
                line = _line(frame, error=str(exc))
            else:
                line = _line(frame, det)
                ok += 1
                if writer is not None:
                    writer.write(frame, det)
        print(line, flush=True)
        emitted += 1
        bar.update(1)

    try:
        for frame in source:
            if args.max_frames is not None and emitted + len(window) >= args.max_frames:
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
        while window:
            emit_oldest()
    finally:
        bar.close()
        engine.close(drain=False)
        if writer is not None:
            writer.close()
    return 0 if ok or emitted == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem detect", description=__doc__.split("\n\n")[0])
    add_detect_arguments(parser)
    return run_detect(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
