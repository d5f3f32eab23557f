"""`tandem bench streams`: how many cameras one machine serves within a latency bound.

    tandem bench streams                       # N = 1, 2, 3, 4, 6, 8, 12, 16 cameras at 5 fps
    tandem bench streams --fps 15 --cameras 1,2,4,8 --bound-ms 250
    tandem bench streams --tiny                # seconds: 1 and 2 cameras (the test runs this)
    tandem bench streams --analytics           # every camera tracked, with a line, a zone and clips

For each N, `python -m sources.loopback --cameras N --stamp` serves N generated cameras in a
process of its own, and N rises until a contestant's frame-to-result p99 passes the bound or
more than `--max-drop` of the frames sent get no result. Contestants, one after the other on
the same cameras, weights (the shipped detector) and size:

- Tandem: a CameraService on a Runtime (defaults: its start-up profile picks batch size and
  path), records read back as JSON lines as they are written;
- the peer a user would run: Ultralytics `predict(source=FILE.streams, stream=True)` on its
  ONNX Runtime export of the same .pt (dynamic batch: `.streams` batches one frame per camera),
  in the side environment of ../shared/PEERS.md. OpenVINO is slower on AVX2-only CPUs.

One latency method for both: each frame carries its camera and frame number in its pixels
(`sources.loopback.stamp`), the camera process logs the Unix time each frame is first sent,
and a frame's latency is the time its result reaches the bench (Tandem: the record is written;
the peer: `predict` yields it) minus that send time. The number is read from the pixels the
detector got (Tandem: the frame as submitted to the Runtime; the peer: `Results.orig_img`).
A frame sent in the measured window that never gets a result is a drop.

`--analytics` gives every Tandem camera what issue 32 adds (ANALYTICS): a ByteTrack tracker, a
line across the middle, a zone over the left half and event clips (5 s before, 5 s after) to
OUT/work/clips_N; the scene's shapes cross both all the time, so clips are recorded without
pause, the busy door's worst case. Run it with and without, and compare the two max_cameras.
The peer runs no analytics either way: it is left out (--no-peer) of that comparison.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import PEERS

PEER_PYTHON = str(PEERS / "yolo" / "bin" / "python")
REPO = Path(__file__).resolve().parents[1]
LOOP_FRAMES = 256  # the scene's loop = the stamp's period: 51 s at 5 fps, far above any latency
# --analytics, on every camera: the scene's shapes bounce over the whole image, so they cross
# the middle line and the left-half zone's edge every few seconds.
ANALYTICS = {
    "tracker": "bytetrack",
    "lines": "middle:0,0.5,1,0.5",
    "zones": "left:0.02,0.02,0.5,0.02,0.5,0.98,0.02,0.98",
    "clips": True,
}


def analytics_options(mode: str | None) -> dict:
    """The options every Tandem camera gets under --analytics MODE ({} without)."""
    if not mode:
        return {}
    return {k: v for k, v in ANALYTICS.items() if k != "clips"} if mode == "no-clips" else ANALYTICS


def add_bench_streams_arguments(p) -> None:
    from tandem.cli import int_list

    p.add_argument("--cameras", type=int_list, default=[1, 2, 3, 4, 6, 8, 12, 16], help="camera counts, rising")
    p.add_argument("--fps", type=float, default=5.0, help="frames per second of every camera (default 5)")
    p.add_argument("--bound-ms", type=float, default=250.0, help="frame-to-result p99 bound (default 250 ms)")
    p.add_argument("--max-drop", type=float, default=0.01, help="largest fraction of frames without a result")
    p.add_argument("--warmup-s", type=float, default=4.0, help="after the first result, before measuring")
    p.add_argument("--duration-s", type=float, default=12.0, help="measured window per camera count")
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--peer-python", default=PEER_PYTHON, help="the Ultralytics side environment's Python")
    p.add_argument("--no-peer", action="store_true", help="Tandem only")
    p.add_argument("--tiny", action="store_true", help="a few seconds: 1 and 2 cameras (for the test)")
    p.add_argument(
        "--analytics",
        nargs="?",
        const="clips",
        choices=("clips", "no-clips"),
        default=None,
        help="every Tandem camera tracked, with a line, a zone and event clips (compare with a run without); "
        "--analytics no-clips: the same without clips, to see the clips' share",
    )
    p.add_argument("--out", default="bench_out/streams")


# ---------------------------------------------------------------- cameras and the one latency method


class Cameras:
    """`python -m sources.loopback` serving N stamped cameras; their send log."""

    def __init__(self, n: int, fps: float, workdir: Path) -> None:
        self.send_log = workdir / f"send_{n}.log"
        self.streams_file = workdir / f"cams_{n}.streams"
        self.send_log.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "sources.loopback", "--cameras", str(n), "--fps", str(fps), "--stamp"]
        cmd += ["--frames", str(LOOP_FRAMES), "--send-log", str(self.send_log)]
        cmd += ["--streams-file", str(self.streams_file), "--stop-on-eof"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.urls = []
        while len(self.urls) < n:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the loopback cameras exited (rc {self.proc.wait()}) before listening")
            if line.startswith("ready "):
                self.urls.append(line.split()[1])
        self.proc.stdout.readline()  # "wrote FILE": the .streams file is complete

    def close(self) -> None:
        self.proc.stdin.close()  # --stop-on-eof: it flushes its log and exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def sends(self) -> dict[int, list[tuple[float, int]]]:
        """camera -> [(send time, frame number)] in time order."""
        out: dict[int, list[tuple[float, int]]] = {}
        for line in self.send_log.read_text().splitlines():
            cam, n, t = line.split()
            out.setdefault(int(cam), []).append((float(t), int(n)))
        for v in out.values():
            v.sort()
        return out


def score(
    sends: dict[int, list[tuple[float, int]]], results: list[tuple[int, int, float, int]], a: float, b: float
) -> dict:
    """One camera count's row from the send log and the results [(camera, stamp, arrival, boxes)]:
    each result is of the newest frame sent before it arrived whose number has its stamp."""
    from benchmarks.common import percentile

    by_stamp = {
        cam: {k: [(t, n) for t, n in v if n % LOOP_FRAMES == k] for k in range(LOOP_FRAMES)} for cam, v in sends.items()
    }
    latency: dict[tuple[int, int], float] = {}
    boxes: dict[tuple[int, int], int] = {}
    unmatched = 0
    for cam, k, arrival, nboxes in results:
        cands = by_stamp.get(cam, {}).get(k, [])
        i = bisect.bisect_right(cands, (arrival, float("inf"))) - 1
        if i < 0:
            unmatched += 1
            continue
        t, n = cands[i]
        latency.setdefault((cam, n), (arrival - t) * 1000)  # a frame's first result counts
        boxes.setdefault((cam, n), nboxes)
    window = [(cam, n) for cam, v in sends.items() for t, n in v if a <= t <= b]
    lat = [latency[f] for f in window if f in latency]
    sent = len(window)
    return {
        "frames_sent": sent,
        "results": len(lat),
        "drop_fraction": None if not sent else round(1 - len(lat) / sent, 4),
        "latency_ms_p50": round(percentile(lat, 50), 1) if lat else None,
        "latency_ms_p99": round(percentile(lat, 99), 1) if lat else None,
        "results_per_s": round(len(lat) / (b - a), 2),
        "unmatched_results": unmatched,
        # the detector sees the scene's shapes: about 3 a frame (one circle, square, triangle)
        "boxes_per_result": round(sum(boxes[f] for f in window if f in boxes) / len(lat), 2) if lat else None,
    }


def _window(first: float, args) -> tuple[float, float]:
    a = first + args.warmup_s
    return a, a + args.duration_s


def _grace_s(args) -> float:
    return 1.0 + 2 * args.bound_ms / 1000  # results of the window's last frames still count


# ---------------------------------------------------------------- Tandem


class _StampedRuntime:
    """The Runtime as CameraService sees it, reading each submitted frame's stamp on the way."""

    def __init__(self, runtime) -> None:
        from sources.loopback import read_stamp

        self._runtime, self._read = runtime, read_stamp
        self.stamps: dict[tuple[str, int], tuple[int, int] | None] = {}

    def submit_detect(self, frame, **kw):
        self.stamps[(frame.source, frame.index)] = self._read(frame.image)
        return self._runtime.submit_detect(frame, **kw)

    def submit_detect_group(self, frames, **kw):  # the muxer's path: a frame of each camera at once
        for frame in frames:
            self.stamps[(frame.source, frame.index)] = self._read(frame.image)
        return self._runtime.submit_detect_group(frames, **kw)

    def __getattr__(self, name):
        return getattr(self._runtime, name)


class _Records:
    """The JSON-lines file CameraService writes: each record's arrival time, as it comes."""

    def __init__(self, stamped: _StampedRuntime) -> None:
        self.stamped, self.results, self.first = stamped, [], None
        self.events = 0  # line crossings and zone entries and exits (--analytics)
        self.cond = threading.Condition()

    def write(self, text: str) -> None:
        now = time.time()
        for line in text.splitlines():
            r = json.loads(line)
            if r.get("frame") is None or r.get("error"):
                continue
            self.events += len(r.get("events") or ())
            s = self.stamped.stamps.pop((r["source"], r["frame"]), None)
            if s is None:
                continue
            with self.cond:
                self.results.append((s[0], s[1], now, len(r.get("boxes") or [])))
                self.first = self.first or now
                self.cond.notify_all()

    def flush(self) -> None:
        pass


def run_tandem(runtime, n: int, args, workdir: Path) -> dict:
    from workers.cameras import CameraService

    cams = Cameras(n, args.fps, workdir)
    stamped = _StampedRuntime(runtime)
    records = _Records(stamped)
    clips_dir = workdir / f"clips_{n}"
    analytics = analytics_options(args.analytics)
    clips = None
    if analytics.get("clips"):
        from workers.camera_clips import ClipConfig

        shutil.rmtree(clips_dir, ignore_errors=True)  # a previous run's clips are not this one's
        clips = ClipConfig(str(clips_dir))
    try:
        service = CameraService(stamped, None, jsonl=records, control=False, clips=clips)
        try:
            for k, url in enumerate(cams.urls):
                service.add(f"cam{k}", url, allow_local=True, **analytics)  # loopback: the operator's own cameras
            with records.cond:
                if not records.cond.wait_for(lambda: records.first is not None, timeout=60):
                    raise RuntimeError("no Tandem record within 60 s")
            a, b = _window(records.first, args)
            time.sleep(max(0.0, b + _grace_s(args) - time.time()))  # the cameras run for the window
            clip_stats = [r["clips"] for r in service.cameras() if r.get("clips")]
        finally:
            service.close()
    finally:
        cams.close()
    row = {"cameras": n, **score(cams.sends(), list(records.results), a, b)}
    if args.analytics:  # what the analytics did, so a run with them is seen to have done the work
        files = sorted(clips_dir.glob("*.mp4"))
        row.update(events=records.events, clips=len(files), clip_bytes=sum(f.stat().st_size for f in files))
        # Did the writer keep up? Frames that left the ring unwritten, clips dropped or failed.
        row.update({f"clip_{k}": sum(c[k] for c in clip_stats) for k in ("frames_missed", "dropped", "failed")})
    return row


# ---------------------------------------------------------------- the peer (runs in its side environment)


def export_peer(args, workdir: Path) -> str:
    """The peer's ONNX Runtime export of the shipped .pt, made by Ultralytics in its environment."""
    from runtime.vision.detector import WEIGHTS

    out = workdir / "peer_export"
    out.mkdir(parents=True, exist_ok=True)
    code = (
        "import shutil, sys; from ultralytics import YOLO; shutil.copy(sys.argv[1], 'shapes.pt'); "
        "print(YOLO('shapes.pt', task='detect').export(format='onnx', imgsz=int(sys.argv[2]), dynamic=True, "
        "nms=False, verbose=False))"
    )
    proc = subprocess.run(
        [args.peer_python, "-c", code, str(WEIGHTS), str(args.imgsz)],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode:
        raise RuntimeError(f"the peer's ONNX export failed: {proc.stderr[-2000:]}")
    return str(out / proc.stdout.strip().splitlines()[-1])


def peer_child(argv: list[str]) -> int:
    """In the side environment: Ultralytics predict on the .streams file; `camera stamp time boxes` lines."""
    import importlib.util

    model_path, source, imgsz, until, out = argv[0], argv[1], int(argv[2]), float(argv[3]), argv[4]
    # sources.loopback by its file: the side environment has OpenCV and numpy, not Tandem's packages
    spec = importlib.util.spec_from_file_location("loopback", REPO / "sources" / "loopback.py")
    loopback = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loopback)
    from ultralytics import YOLO

    model = YOLO(model_path, task="detect")
    with open(out, "w", buffering=1) as f:
        for r in model.predict(source, stream=True, imgsz=imgsz, verbose=False):
            now = time.time()
            s = loopback.read_stamp(r.orig_img)
            if s is not None:
                f.write(f"{s[0]} {s[1]} {now:.6f} {len(r.boxes)}\n")
            if now > until:
                break
    os._exit(0)  # its stream threads would keep the process up for a while


def run_peer(model_path: str, n: int, args, workdir: Path) -> dict:
    cams = Cameras(n, args.fps, workdir)
    out = workdir / f"peer_{n}.txt"
    out.unlink(missing_ok=True)
    try:
        # Its start (imports, model, opening every stream) is not timed: the window starts
        # warmup_s after its first result, as Tandem's does; `until` bounds the whole run.
        budget = 120 + args.warmup_s + args.duration_s + _grace_s(args)
        cmd = [args.peer_python, "-m", "benchmarks.streams", "--peer-child", model_path, str(cams.streams_file)]
        cmd += [str(args.imgsz), str(time.time() + budget), str(out)]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        first = None
        deadline = time.time() + budget
        while time.time() < deadline and proc.poll() is None:
            results = _read_peer(out)
            if first is None and results:
                first = results[0][2]
            if first is not None and time.time() > _window(first, args)[1] + _grace_s(args):
                break
            time.sleep(0.2)  # polling a file another process writes; nothing to wait on
        proc.kill()
        err = proc.communicate()[1]
        results = _read_peer(out)
        if not results:
            raise RuntimeError(f"the peer gave no result: {err[-2000:]}")
        a, b = _window(results[0][2], args)
    finally:
        cams.close()
    return {"cameras": n, **score(cams.sends(), results, a, b)}


def _read_peer(path: Path) -> list[tuple[int, int, float, int]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:  # a line being written is not one yet
            rows.append((int(parts[0]), int(parts[1]), float(parts[2]), int(parts[3])))
    return rows


# ---------------------------------------------------------------- the run


def passed(row: dict, args) -> bool:
    p99, drop = row["latency_ms_p99"], row["drop_fraction"]
    return p99 is not None and drop is not None and p99 <= args.bound_ms and drop <= args.max_drop


def sweep(name: str, measure, counts: list[int], args) -> dict:
    """Rising camera counts until one fails: the rows and the largest count that passed."""
    from tqdm import tqdm

    rows, best = [], 0
    bar = tqdm(counts, desc=name, unit="count", file=sys.stderr)
    for n in bar:
        row = measure(n)
        row["passed"] = passed(row, args)
        rows.append(row)
        bar.write(
            f"{name:8} N={n:3}  p50 {row['latency_ms_p50']} ms  p99 {row['latency_ms_p99']} ms  "
            f"drops {row['drop_fraction']}  results/s {row['results_per_s']}  {'ok' if row['passed'] else 'FAIL'}"
            + (
                f"  events {row['events']}  clips {row['clips']} (frames missed {row['clip_frames_missed']})"
                if "events" in row
                else ""
            )
        )
        if not row["passed"]:
            break
        best = n
    bar.close()
    # capped: every count passed, so the machine serves at least max_cameras (raise --cameras)
    return {"rows": rows, "max_cameras": best, "capped": best == counts[-1]}


def run_bench(args) -> int:
    from benchmarks.common import cpu_info, no_nan

    if args.tiny:
        args.cameras, args.warmup_s, args.duration_s = [1, 2], 1.5, 3.0
    counts = sorted(set(args.cameras))
    out = Path(args.out)
    workdir = out / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags: {cpu['flags']}", flush=True)
    print(f"load average before: {os.getloadavg()}", flush=True)
    print(
        f"cameras {counts} at {args.fps} fps, imgsz {args.imgsz}, bound p99 <= {args.bound_ms} ms, "
        f"drops <= {args.max_drop:.1%}"
        + (f", Tandem with analytics {analytics_options(args.analytics)}" if args.analytics else ""),
        flush=True,
    )
    report: dict = {
        "bench": "streams",
        "command": " ".join(["tandem", "bench", "streams", *sys.argv[2:]]) if sys.argv[1:2] == ["streams"] else None,
        "cpu": {k: cpu[k] for k in ("model", "cores", "flags")},
        "load_average_before": list(os.getloadavg()),
        "config": {
            "fps": args.fps,
            "cameras": counts,
            "bound_ms": args.bound_ms,
            "max_drop": args.max_drop,
            "warmup_s": args.warmup_s,
            "duration_s": args.duration_s,
            "imgsz": args.imgsz,
            "tiny": args.tiny,
            "analytics": analytics_options(args.analytics) or None,
        },
        "method": "frame number and camera stamped in the pixels; latency = result arrival (Unix time) "
        "minus the camera process's logged send time of that frame; a frame sent in the window "
        "with no result is a drop",
    }
    from runtime.runtime import Runtime
    from runtime.vision.detector import WEIGHTS

    vision = {"model": str(WEIGHTS), "imgsz": args.imgsz, "device": "cpu"}
    report["tandem_vision_config"] = vision
    with Runtime(vision=vision) as runtime:
        report["tandem"] = sweep("tandem", lambda n: run_tandem(runtime, n, args, workdir), counts, args)
    if args.no_peer:
        report["peer"] = {"skipped": "--no-peer"}
    elif not Path(args.peer_python).exists():
        report["peer"] = {"skipped": f"no side environment at {args.peer_python} (../shared/PEERS.md)"}
    else:
        model_path = export_peer(args, workdir)
        report["peer"] = {
            "name": "ultralytics predict, ONNX Runtime export (dynamic batch)",
            "model": model_path,
            **sweep("peer", lambda n: run_peer(model_path, n, args, workdir), counts, args),
        }
    if "skipped" in report["peer"]:
        print(f"peer skipped: {report['peer']['skipped']}", flush=True)
    t, p = report["tandem"]["max_cameras"], report["peer"].get("max_cameras")
    report["ratio"] = None if not p else round(t / p, 3)  # a lower bound where Tandem's sweep was capped
    report["target_ratio"] = 1.5
    report["target_met"] = None if report["ratio"] is None else report["ratio"] >= 1.5
    report["load_average_after"] = list(os.getloadavg())
    print(
        f"largest N within p99 {args.bound_ms:.0f} ms and {args.max_drop:.0%} drops at {args.fps} fps: "
        f"Tandem {'>=' if report['tandem']['capped'] else ''}{t}, peer {p if p is not None else '-'}"
        + (
            ""
            if report["ratio"] is None
            else f", ratio {report['ratio']}x (target 1.5x: {'met' if report['target_met'] else 'NOT met'})"
        ),
        flush=True,
    )
    (out / "streams.json").write_text(json.dumps(no_nan(report), indent=2))
    _plot(report, args, out / "streams.png")
    print(f"wrote {out / 'streams.json'} and {out / 'streams.png'}", flush=True)
    return 0


def _plot(report: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    tandem = {"clips": "Tandem, line + zone + clips", "no-clips": "Tandem, line + zone"}.get(args.analytics, "Tandem")
    for key, label in (("tandem", tandem), ("peer", "Ultralytics + ONNX Runtime")):
        rows = report[key].get("rows") or []
        if rows:
            xs = [r["cameras"] for r in rows]
            ys = [r["latency_ms_p99"] or float("nan") for r in rows]
            ax.plot(xs, ys, marker="o", label=f"{label} (max {report[key]['max_cameras']} cameras)")
    ax.axhline(args.bound_ms, color="grey", linestyle="--", label=f"bound {args.bound_ms:.0f} ms")
    ax.set_xlabel(f"cameras at {args.fps:g} fps")
    ax.set_ylabel("frame-to-result p99 (ms)")
    ax.set_yscale("log")
    ax.set_title(f"tandem bench streams ({report['cpu']['cores']} cores, {report['cpu']['flags']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer-child"]:
        sys.exit(peer_child(sys.argv[2:]))
    sys.exit("run it as `tandem bench streams` (python -m benchmarks streams)")
