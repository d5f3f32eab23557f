"""Boundaries a newcomer can rely on."""

from __future__ import annotations

import os
import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def test_schedulers_never_import_torch():
    mods = _modules_after("import schedulers, schedulers.continuous, schedulers.static, schedulers.dynamic")
    assert "torch" not in mods and "numpy" not in mods


def test_memory_manager_and_cli_parser_import_without_torch():
    mods = _modules_after("import runtime.memory, tandem.cli; tandem.cli.build_parser()")
    assert "torch" not in mods


def _threads_after(code: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    return int(out.split()[-1])


def test_importing_ultralytics_through_tandem_keeps_torch_threads():
    plain = _threads_after("")
    ours = _threads_after("from runtime.vision.ultralytics_import import import_ultralytics; import_ultralytics()")
    assert ours == plain
    if plain > 1:  # the side effect guarded against: a bare import makes torch single-threaded
        assert _threads_after("import ultralytics") == 1
