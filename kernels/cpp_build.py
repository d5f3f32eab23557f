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

Each op module holds one `Library`: its state (loaded or not, why it failed) and its env
switch (auto | cpp | torch), built or loaded once per process; when the build fails it warns
once and the module falls back to torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
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


class Library:
    """One op module's C++ library: built or loaded from the cache once per process, on first
    use, from `sources` as the library `name` (see load); `env_var` is its switch (see mode) and
    `what` names the module in the warning of a failed build.

    A test may stand a failing `build` in on the instance, and reset `loaded` to None to try
    again."""

    def __init__(self, name: str, sources: str | Sequence[str], env_var: str, what: str, simd: bool = True) -> None:
        self.name, self.sources, self.env_var, self.what, self.simd = name, sources, env_var, what, simd
        self.loaded: bool | None = None  # None: not tried yet
        self.info: dict[str, object] = {}
        self._lock = threading.Lock()

    def mode(self) -> str:
        return mode(self.env_var)

    def build(self) -> None:
        self.info.update(load(self.name, self.sources, self.simd))

    def ensure_built(self) -> bool:
        """Build or load the library once per process; False (after one warning) when it cannot."""
        if self.loaded is None:
            with self._lock:
                if self.loaded is None:
                    # self.build is looked up here, at the call, so a test can stand a failing one in.
                    self.loaded = try_build(self.build, self.mode() == "cpp", self.info, self.what)
        return self.loaded

    def available(self) -> bool:
        """Whether the C++ ops are in use: loaded, or (unless the switch says "torch") built or
        loaded from the cache by this call."""
        if self.loaded:
            return True
        return self.mode() != "torch" and self.ensure_built()

    def build_info(self) -> dict[str, object]:
        """Where the library was built and how long building or loading took, or why it failed."""
        return dict(self.info)

    def use_cpp(self, *tensors: torch.Tensor) -> bool:
        """For an op's Python implementation, which CPU calls reach only until the library is
        loaded: whether to call the C++ op for these tensors."""
        if not all(t.device.type == "cpu" for t in tensors) or self.mode() == "torch":
            return False
        return self.ensure_built()
