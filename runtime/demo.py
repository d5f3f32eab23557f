"""`tandem demo` (the README's `make demo`): the mixed workload on embedded defaults, with no
external services. One Runtime serves chat requests (arriving at random) and two loopback
cameras at the same time; it prints the answers, both workloads' latencies and the memory
budget by owner."""

from __future__ import annotations

import time

SEED_LENGTHS = [5, 50, 8, 12, 40, 3, 30, 7]


def _banner(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def run_scheduler_demo() -> None:
    from runtime.simulate import format_report

    _banner("Schedulers: the seed example, static vs continuous batching (no model)")
    print(format_report(SEED_LENGTHS, 4))


def run_llm_part(rt, workload) -> dict:
    """Chat requests with Poisson arrivals; prints each answer as it completes."""
    from runtime.mixed import drive

    def show(i: int, question: str, out) -> None:
        m = out.metrics
        print(f"\nQ{i}: {question}\nA{i}: {out.text.strip()}")
        print(
            f"    [{len(out.token_ids)} tokens, {out.finish_reason}, TTFT {m.time_to_first_token * 1000:.0f} ms, "
            f"end to end {m.e2e_latency:.1f} s]"
        )

    return drive(rt, None, workload, on_answer=show).llm


class Cameras:
    """Loopback MJPEG cameras read as a `.streams` source (newest frame of each), every frame
    sent to the Runtime with a deadline while the chat requests run."""

    def __init__(self, rt, num: int = 2, fps: float = 5.0, deadline_s: float = 0.5) -> None:
        import threading

        from runtime.vision.demo import demo_scenes
        from sources.loopback import MjpegServer
        from sources.streams import StreamsSource

        self.rt, self.deadline_s = rt, deadline_s
        # Each camera shows a slideshow of generated scenes the detector was not trained on.
        self.servers = [MjpegServer([img for img, _ in demo_scenes(15, seed=100 + k)], fps=fps) for k in range(num)]
        self.source = StreamsSource([s.url for s in self.servers])
        self.records: list[tuple[dict, object]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="demo-cameras", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while not self._stop.is_set():
            for frame in self.source.next_batch(timeout=0.2):
                if frame.error is not None:
                    self.errors.append(frame.error)
                    continue
                record = {"submitted": time.monotonic(), "done": None, "stream": frame.source}
                future = self.rt.submit_detect(frame, deadline_s=self.deadline_s)
                future.add_done_callback(lambda f, r=record: r.__setitem__("done", time.monotonic()))
                self.records.append((record, future))

    def stop(self) -> dict:
        from runtime.mixed import vision_summary

        self._stop.set()
        self._thread.join()
        for _, f in self.records:
            f.exception()  # wait for each
        self.source.close()
        for s in self.servers:
            s.close()
        wall = (self.records[-1][0]["submitted"] - self.records[0][0]["submitted"]) if len(self.records) > 1 else 0.0
        summary = vision_summary(self.records, wall, self.deadline_s)
        summary["boxes_last_frame"] = (
            len(self.records[-1][1].result()) if self.records and not self.records[-1][1].exception() else None
        )
        summary["stream_errors"] = self.errors
        return summary


def _print_memory(memory) -> None:
    stats = memory.stats()
    mib = 2**20
    print(f"device budget {stats['total_bytes'] / mib:.0f} MiB, every byte with an owner:")
    for owner, n in stats["owners"].items():
        print(f"  {owner:<22}{n / mib:>9.1f} MiB")
    print(f"  {'(unreserved)':<22}{stats['free_bytes'] / mib:>9.1f} MiB")
    kv = stats.get("kv_blocks")
    if kv:
        print(
            f"  KV pool: {kv['total']} blocks of {kv['block_size']} tokens, {kv['bytes_per_block'] / 1024:.0f} KiB each"
        )


def show_detections(rt, n: int = 4) -> None:
    """A few held-out generated images through the Runtime: what the shipped detector found
    beside what was drawn."""
    from runtime.vision.demo import demo_scenes, describe
    from runtime.vision.synthetic import TEST_SEED

    _banner("Detections: Tandem's trained shapes detector on images it has not seen")
    scenes = demo_scenes(n, TEST_SEED + 1)
    futures = [rt.submit_detect(img) for img, _ in scenes]
    for i, ((_, drawn), future) in enumerate(zip(scenes, futures)):
        print(f"image {i}: found [{describe(future.result())}]\n         drawn [{', '.join(drawn)}]")


def run_demo(vision: bool = True, llm: bool = True) -> int:
    from runtime.memory import DeviceMemoryManager, MemoryConfig
    from runtime.mixed import MixedWorkload
    from runtime.runtime import Runtime

    t0 = time.perf_counter()
    run_scheduler_demo()
    if not (vision or llm):
        return 0
    _banner("One Runtime, one device, two workloads: loading")
    t1 = time.perf_counter()
    vision_config = None
    if vision:
        from runtime.vision.demo import demo_config
        from runtime.vision.ultralytics_import import import_ultralytics

        import_ultralytics()
        vision_config = demo_config()
    memory = DeviceMemoryManager(MemoryConfig(budget_bytes=3 * 2**30))
    # Vision reserves its weights, batch buffers and activation peak first; the LLM takes its
    # weights and activations, and the rest of the budget becomes KV blocks.
    with Runtime(llm={} if llm else None, vision=vision_config, memory=memory) as rt:
        print(f"loaded in {time.perf_counter() - t1:.1f} s")
        _print_memory(memory)
        if vision:
            show_detections(rt)
        cameras = Cameras(rt) if vision else None
        if llm:
            _banner("Chat requests (SmolLM2-135M-Instruct, continuous batching) while cameras stream")
            workload = MixedWorkload(
                num_requests=6, request_rate=2.0, max_tokens=64, repetition_penalty=1.2, llm_deadline_s=30.0
            )
            llm_summary = run_llm_part(rt, workload)
        else:
            time.sleep(5.0)  # vision alone: let the cameras run a few seconds
            llm_summary = None
        frames = cameras.stop() if cameras is not None else None
        stats = rt.stats()
    _banner("Latencies, both workloads served at the same time by one Runtime")
    if llm_summary:
        ttft, itl = llm_summary["ttft_ms"], llm_summary["itl_ms"]
        print(
            f"LLM:    {llm_summary['requests']} requests, TTFT p50 {ttft['p50']:.0f} ms / p99 {ttft['p99']:.0f} ms, "
            f"inter-token p50 {itl['p50']:.0f} ms / p99 {itl['p99']:.0f} ms, {llm_summary['tokens_per_s']:.1f} tokens/s, "
            f"deadlines met {llm_summary['deadline_met']:.0%}"
        )
    if frames:
        lat = frames["latency_ms"]
        print(
            f"vision: {frames['completed']}/{frames['frames']} camera frames, frame-to-result p50 "
            f"{lat['p50']:.0f} ms / p99 {lat['p99']:.0f} ms, {frames['frames_per_s']:.1f} frames/s, "
            f"deadline ({Cameras.__init__.__defaults__[2] * 1000:.0f} ms) met {frames['deadline_met']:.0%}"
            + (f", stream errors: {frames['stream_errors']}" if frames["stream_errors"] else "")
        )
        print(f"        boxes in the last frame: {frames['boxes_last_frame']}")
    arb = stats["arbiter"]
    print(f"arbiter turns {arb['turns']}, reasons {arb['reasons']}")
    print(f"after close: {memory.stats()['reserved_bytes']} bytes reserved (every reservation released)")
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    return 0
