"""Which device a command runs on: one rule for every command's --device (generate, chat,
serve --embedded, worker, detect, streams), so that each fails alike, in a second, naming its
flag and what this machine has."""

from __future__ import annotations

import re


def default_device() -> str:
    """CUDA where torch sees a GPU, else the CPU (the LLM engine's rule too:
    runtime.llm.engine.EngineConfig.resolved_device)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_problem(flag: str, value: str | None) -> str | None:
    """Why `value` cannot be used as a device here, naming `flag` and what this machine has;
    None when it can. Imports torch but loads nothing, so a bad flag fails in a second."""
    if value is None or value == "cpu":
        return None
    import torch

    num_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has_mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    have = ["cpu"] + [f"cuda:{i}" for i in range(num_cuda)] + (["mps"] if has_mps else [])
    have_text = f"this machine has: {', '.join(have)}"
    m = re.fullmatch(r"cuda(?::(\d+))?", value)
    if m:
        if num_cuda == 0:
            why = "built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
            return f"{flag} {value}: torch sees no GPU ({why}); {have_text}"
        if m.group(1) is not None and int(m.group(1)) >= num_cuda:
            return f"{flag} {value}: there is no GPU {m.group(1)}; {have_text}"
        return None
    if value == "mps":
        return None if has_mps else f"{flag} mps: no Apple GPU here; {have_text}"
    return f"{flag} must be cpu, cuda, cuda:N or mps, got {value!r}; {have_text}"


def checked_device(flag: str, value: str | None) -> str:
    """`value`, or the default device when it is None; ValueError naming `flag` when this
    machine cannot run it."""
    if value is None:
        return default_device()
    problem = device_problem(flag, value)
    if problem:
        raise ValueError(problem)
    return value
