"""Attention kernels over the paged KV cache.

paged_attention: pure torch, the CPU path and the reference any faster kernel must match.
triton_attention: Triton kernels for CUDA (write_kv, paged decode, varlen paged prefill), each
with a torch reference; `python -m benchmarks.gpu_kernels` checks and times them on a GPU.
"""
