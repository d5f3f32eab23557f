"""Building the project's C++ CPU ops on first use: what kernels/cpu_attention.py and
kernels/quant_linear.py share.

Each op is one or a few .cpp files compiled by torch.utils.cpp_extension (g++ and ninja) into
$TANDEM_CACHE_DIR (or ~/.cache/tandem)/torch_extensions/<name>/<key> and loaded into the process
as a library of torch ops (no Python module). The key names torch's version, the Python ABI,
the SIMD level the file is compiled for and a hash of the CPU's flags, the compiler flags and
the sources' paths, so a cache shared between machines, environments or checkouts never hands
one a binary built for another, nor makes two take turns rebuilding it.

Two ways to target the CPU:
  simd=True   the whole file is compiled for the SIMD level torch itself dispatches to here
              (-DCPU_CAPABILITY_* and the -m flags), so ATen's at::vec intrinsics are usable;
              the binary then runs only on CPUs with that level (the key says which).
  simd=False  baseline flags only: the file picks its instruction sets at run time (per-function
              target attributes and CPUID), so the binary runs on any x86-64 CPU.

Each op module keeps its own state (loaded or not, why it failed) and its own env switch
(auto | cpp | torch); `mode` and `try_build` are the shared halves of that: read the switch,
build once and, when the build fails, warn once and let the module fall back to torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

# Build flags per SIMD level, as inductor compiles its own CPU kernels: the CPU_CAPABILITY_*
# macro selects at::vec's intrinsics, the -m flags let the compiler emit them. The level is
# the one torch itself dispatches to here (it checks the OS saves the wide registers too).
ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mf16c"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}

# Errors a failed build or load raises: no compiler or ninja, a compile error, a missing
# header, a library that does not load.
BUILD_ERRORS = (RuntimeError, OSError, ImportError, subprocess.SubprocessError)


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    return " ".join(sorted(line.partition(":")[2].split()))


def _paths(sources: str | Sequence[str]) -> list[str]:
    return [sources] if isinstance(sources, str) else list(sources)


def build_config(name: str, sources: str | Sequence[str], simd: bool = True) -> tuple[str, list[str]]:
    """(build directory, compiler flags) of the library `name` built from `sources` (one path
    or several)."""
    isa = torch.backends.cpu.get_cpu_capability()
    cflags = ["-O3", "-fopenmp", "-DNDEBUG", *(ISA_FLAGS.get(isa, []) if simd else [])]
    # The sources' paths too: ninja rebuilds when the command it recorded changes, and two
    # checkouts sharing one folder (a worker of each, one venv) rebuilt it at every start, for
    # 12 to 69 s, each build holding the folder's lock against the other's workers. (One source
    # keys as before. Contents are ninja's to track: it runs at every load, and rebuilds an
    # object whose source or included headers changed, from the compiler's depfiles.)
    paths = "|".join(_paths(sources))
    digest = hashlib.sha256(f"{cpu_flags()}|{' '.join(cflags)}|{paths}".encode()).hexdigest()[:12]
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    level = isa.lower() if simd else "runtime-dispatch"
    key = f"torch-{torch.__version__}-{sys.implementation.cache_tag}-{level}-{digest}"
    return os.path.join(root, "torch_extensions", name, key), cflags


def load(name: str, sources: str | Sequence[str], simd: bool = True) -> dict[str, object]:
    """Compile `sources` (one path or several, linked into one library), or find them compiled,
    and load them as a library of torch ops; returns where it was built and how long building or
    loading took."""
    t0 = time.perf_counter()
    # Importing cpp_extension warns on a host without CUDA that it found no CUDA runtime,
    # which says nothing about these CPU-only builds.
    ext_logger = logging.getLogger("torch.utils.cpp_extension")
    level = ext_logger.level
    ext_logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        ext_logger.setLevel(level)

    build_dir, cflags = build_config(name, sources, simd)
    os.makedirs(build_dir, exist_ok=True)
    # at::parallel_for's OpenMP loop is compiled into the op (ATen's headers inline it), so
    # the op runs on one thread unless it is compiled with -fopenmp; linking libgomp names
    # the runtime torch has already loaded (same soname), not a second one.
    cpp_extension.load(
        name=name,
        sources=_paths(sources),
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        build_directory=build_dir,
        is_python_module=False,
        verbose=False,
    )
    info: dict[str, object] = dict(build_dir=build_dir, load_seconds=time.perf_counter() - t0)
    logger.info("%s ready in %.1f s (%s)", name, info["load_seconds"], build_dir)
    return info


def mode(env_var: str) -> str:
    """The env switch of one op: "auto" (default: C++ when it builds), "cpp" (C++ or raise)
    or "torch" (never build)."""
    value = os.environ.get(env_var, "auto").strip().lower() or "auto"
    if value not in ("auto", "cpp", "torch"):
        raise ValueError(f"{env_var} must be auto, cpp or torch, got {value!r}")
    return value


def try_build(build: Callable[[], None], strict: bool, info: dict[str, object], what: str) -> bool:
    """Run `build` (the caller holds its lock and calls this once per process): True when it
    loaded; False after one RuntimeWarning saying why, with the reason in info["error"];
    raises instead when `strict` (the switch says "cpp")."""
    try:
        build()
        return True
    except BUILD_ERRORS as exc:
        if strict:
            raise
        info["error"] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"{what}: the C++ op did not build, using the torch path ({info['error']})", RuntimeWarning, stacklevel=4
        )
        return False
