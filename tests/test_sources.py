"""Frame sources: every kind, every bad input, and live loopback streams (one dead)."""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stream_helpers import take_until

from sources import FileSource, SourceError, StreamConfig, StreamsSource, load_source, parse_streams_file
from sources.loopback import MjpegServer, dead_url


def _image(path, h=48, w=64, value=90):
    img = np.full((h, w, 3), value, np.uint8)
    cv2.imwrite(str(path), img)
    return img


def _video(path, n=7, size=(64, 48)):
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10, size)
    for i in range(n):
        writer.write(np.full((size[1], size[0], 3), 20 * i, np.uint8))
    writer.release()


def test_image_file_directory_and_glob(tmp_path):
    _image(tmp_path / "b.png")
    _image(tmp_path / "a.jpg")
    (tmp_path / "notes.md").write_text("not an image; skipped inside a directory")
    one = list(load_source(str(tmp_path / "a.jpg")))
    assert [f.source for f in one] == [str(tmp_path / "a.jpg")] and one[0].image.shape == (48, 64, 3)
    frames = list(load_source(tmp_path))
    assert [os.path.basename(f.source) for f in frames] == ["a.jpg", "b.png"]
    assert all(f.ok and f.index == 0 for f in frames)
    globbed = load_source(str(tmp_path / "*.png"))
    assert globbed.total == 1 and [os.path.basename(f.source) for f in globbed] == ["b.png"]


def test_txt_list_resolves_relative_paths_and_reports_missing_files(tmp_path, monkeypatch):
    sub = tmp_path / "imgs"
    sub.mkdir()
    _image(sub / "x.jpg")
    lst = tmp_path / "list.txt"
    lst.write_text("# comment\nimgs/x.jpg\n\nimgs/missing.jpg\n")
    monkeypatch.chdir("/")  # relative entries resolve against the list's folder, not the cwd
    frames = list(load_source(str(lst)))
    assert frames[0].ok and frames[0].source == str(sub / "x.jpg")
    assert not frames[1].ok and "line 4" in frames[1].error and "missing.jpg" in frames[1].error


def test_arrays_and_pil_images():
    from PIL import Image

    bgr = np.zeros((10, 12, 3), np.uint8)
    bgr[..., 2] = 255  # red in BGR
    pil = Image.fromarray(np.dstack([np.full((10, 12), 255, np.uint8), np.zeros((10, 12, 2), np.uint8)]))  # red RGB
    frames = list(load_source([bgr, pil, np.zeros((4, 4), np.float32)]))
    assert frames[0].source == "array:0" and np.array_equal(frames[0].image, frames[1].image)
    assert "uint8" in frames[2].error and frames[2].image is None


def test_video_every_frame_and_stride(tmp_path):
    _video(tmp_path / "v.mp4", n=7)
    src = load_source(str(tmp_path / "v.mp4"))
    assert [f.index for f in src] == list(range(7)) and src.total == 7
    strided = load_source(str(tmp_path / "v.mp4"), vid_stride=3)
    assert [f.index for f in strided] == [0, 3, 6] and strided.total == 3


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: str(p / "nope.jpg"), "source not found"),
        (lambda p: (p / "empty").mkdir() or str(p / "empty"), "holds no images"),
        (lambda p: str(p / "*.webp"), "matches no images"),
        (lambda p: (p / "blank.txt").write_text("\n# only a comment\n") and str(p / "blank.txt"), "names no files"),
    ],
)
def test_sources_that_cannot_start_raise_clear_errors(tmp_path, make, message):
    with pytest.raises(SourceError, match=message):
        load_source(make(tmp_path))


def test_corrupt_and_non_image_files_are_error_entries_and_the_rest_go_on(tmp_path):
    _image(tmp_path / "a.jpg")
    (tmp_path / "b.jpg").write_bytes(b"\xff\xd8 definitely not a jpeg")
    (tmp_path / "c.jpg").write_bytes(b"")
    _image(tmp_path / "d.jpg")
    (tmp_path / "e.mp4").write_bytes(b"not a video")
    frames = list(FileSource(tmp_path))
    by_name = {os.path.basename(f.source): f for f in frames}
    assert by_name["a.jpg"].ok and by_name["d.jpg"].ok
    assert "cannot decode image" in by_name["b.jpg"].error and "b.jpg" in by_name["b.jpg"].error
    assert "empty" in by_name["c.jpg"].error
    assert "e.mp4" in by_name["e.mp4"].error
    readme = tmp_path / "README"
    readme.write_text("hello")
    (only,) = list(load_source(str(readme)))  # named explicitly: tried, and the error says why
    assert "cannot decode image" in only.error


def test_malformed_streams_line_names_the_line(tmp_path):
    f = tmp_path / "cams.streams"
    f.write_text("# cameras\nrtsp://127.0.0.1:8554/a\n\nnot a url at all\n")
    with pytest.raises(SourceError, match=r"line 4: 'not a url at all'"):
        parse_streams_file(str(f))
    f.write_text("http://\n")
    with pytest.raises(SourceError, match="line 1.*no host"):
        parse_streams_file(str(f))
    with pytest.raises(SourceError, match="source not found"):
        load_source(str(tmp_path / "missing.streams"))


def test_stream_config_is_validated():
    with pytest.raises(ValueError, match="buffer"):
        StreamConfig(buffer=-1)
    with pytest.raises(ValueError, match="backoff_max_s"):
        StreamConfig(backoff_initial_s=5, backoff_max_s=1)


def _ok_from(frames, stream):
    return sum(fr.ok and fr.stream == stream for fr in frames)


def test_dead_stream_is_reported_and_live_streams_keep_producing(tmp_path):
    with MjpegServer(fps=20) as a, MjpegServer(fps=20) as b:
        f = tmp_path / "cams.streams"
        f.write_text(f"{a.url}\n{dead_url()}\n{b.url}\n")
        src = load_source(str(f), stream_config=StreamConfig(backoff_initial_s=0.1, backoff_max_s=0.2))
        try:

            def both_live_while_it_retries(frames, retries, live):
                return src.health()[1].reconnects >= retries and min(_ok_from(frames, 0), _ok_from(frames, 2)) >= live

            # Take frames until the dead stream has failed twice and is connecting a third time:
            # an error per retry would by then have put two error frames out.
            frames = take_until(src, lambda fr: both_live_while_it_retries(fr, retries=2, live=5), 10.0)
            frames += src.next_batch(timeout=0)  # an error queued after the last batch was taken
            errors = [fr for fr in frames if fr.error]
            assert len(errors) == 1  # reported once when it goes down, not on every retry
            assert errors[0].stream == 1 and "refused" in errors[0].error.lower()
            assert {fr.stream for fr in frames if fr.ok} == {0, 2}
            health = {h.stream: h for h in src.health()}
            assert health[1].state in ("retrying", "connecting") and health[1].reconnects >= 2 and health[1].last_error
            assert health[0].state == "live" and health[2].state == "live"
            # The dead one never stops the others: both deliver more while it retries again.
            retries = health[1].reconnects
            later = take_until(src, lambda fr: both_live_while_it_retries(fr, retries + 1, live=3), 10.0)
            assert not any(fr.stream == 1 for fr in later)  # down already reported, silent since
        finally:
            src.close()
        assert not any(r.alive for r in src.readers)


def test_newest_frame_only_drops_stale_frames_and_fifo_keeps_order():
    with MjpegServer(fps=50) as cam:
        latest = StreamsSource([cam.url], StreamConfig())
        fifo = StreamsSource([cam.url], StreamConfig(buffer=100))
        try:
            # Nobody consumes until both have read several frames: newest-only keeps 1, the FIFO all.
            assert latest.wait_for(lambda h: h[0].frames_dropped >= 5, timeout=10)
            assert fifo.wait_for(lambda h: h[0].frames_read >= 5, timeout=10)
            (seen,) = latest.health()
            (newest,) = latest.next_batch(timeout=0)
            assert seen.frames_dropped == seen.frames_read - 1  # every frame but the newest was dropped
            assert newest.index >= seen.frames_read - 1  # the frame taken is the newest, not a stale one
            taken = [fr.index for _ in range(5) for fr in fifo.next_batch(timeout=0)]
            assert taken == [0, 1, 2, 3, 4] and fifo.health()[0].frames_dropped == 0
        finally:
            latest.close()
            fifo.close()


def test_stalled_stream_times_out_and_is_retried():
    with MjpegServer(stall=True) as cam:
        src = StreamsSource([cam.url], StreamConfig(read_timeout_s=0.3, backoff_initial_s=0.1, max_retries=1))
        try:
            failed = src.wait_for(lambda h: h[0].state == "failed", timeout=10)
            assert failed, "max_retries=1 must end the stream after the second stall"
            frames = list(src)  # its error frames, then the end: a failed stream is finished
            assert src.finished
            # one error when it went down, one when it gave up: both say the read timed out
            assert len(frames) == 2 and all(not fr.ok and "timed out" in fr.error.lower() for fr in frames)
            (health,) = src.health()
            assert health.reconnects == 1 and health.frames_read == 0  # retried once, never sent a frame
        finally:
            src.close()


def test_local_video_in_streams_file_plays_to_its_end(tmp_path):
    _video(tmp_path / "v.mp4", n=5)
    f = tmp_path / "s.streams"
    f.write_text("v.mp4\n")
    src = load_source(str(f), stream_config=StreamConfig(pace_files=False, buffer=10))
    frames = list(src)  # ends by itself: a file is a finite stream
    src.close()
    assert [fr.index for fr in frames] == list(range(5))
