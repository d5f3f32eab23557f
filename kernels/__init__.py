"""Attention kernels over the paged KV cache.

paged_attention: pure torch, the CPU path and the reference any faster kernel must match.
"""
