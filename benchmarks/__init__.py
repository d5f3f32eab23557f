"""Tandem's measuring tools: benchmarks against peers run in the same process or script, and
the GPU checks. They sit beside the product, not inside it: they import any layer of it, and
nothing of the product imports them.

    python -m benchmarks llm --quick         # or: tandem bench llm --quick
    python -m benchmarks gpu-kernels --out bench_out

`benchmarks/cli.py` lists every command; `benchmarks/common.py` holds what several share.
"""
