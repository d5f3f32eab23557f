"""Boundaries a newcomer can rely on."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True,
    ).stdout
    return set(out.split())


def test_schedulers_never_import_torch():
    mods = _modules_after("import schedulers, schedulers.continuous, schedulers.static, schedulers.dynamic")
    assert "torch" not in mods and "numpy" not in mods


def test_memory_manager_and_cli_parser_import_without_torch():
    mods = _modules_after("import runtime.memory, runtime.cli; runtime.cli.build_parser()")
    assert "torch" not in mods
