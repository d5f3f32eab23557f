"""The seed documents' worked example, reproduced by the real schedulers."""

from __future__ import annotations

import subprocess
import sys

from runtime.simulate import seed_formula, simulate

SEED_LENGTHS = [5, 50, 8, 12, 40, 3, 30, 7]


def test_seed_example_exactly():
    static, continuous = simulate(SEED_LENGTHS, 4)
    assert (static.steps, round(static.busy * 100)) == (90, 43)
    assert (continuous.steps, round(continuous.busy * 100)) == (50, 78)


def test_schedulers_match_the_seed_formula_for_other_workloads():
    for lengths, slots in [([3, 1, 4, 1, 5, 9, 2, 6], 3), ([10] * 7, 2), ([1, 100, 1, 1], 2), ([7], 5)]:
        static, continuous = simulate(lengths, slots)
        assert (static.steps, continuous.steps) == seed_formula(lengths, slots), (lengths, slots)


def test_tandem_simulate_cli_prints_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "simulate", "--lengths", "5,50,8,12,40,3,30,7", "--slots", "4"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert any(line.split()[:3] == ["static", "90", "43%"] for line in lines), out
    assert any(line.split()[:3] == ["continuous", "50", "78%"] for line in lines), out


def test_simulate_rejects_bad_lengths():
    bad = subprocess.run(
        [sys.executable, "-m", "tandem", "simulate", "--lengths", "5,x", "--slots", "4"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "--lengths" in bad.stderr
