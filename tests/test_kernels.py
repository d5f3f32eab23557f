"""Paged attention (kernels/paged_attention.py) against dense causal SDPA on random data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_attention import (
    decode_mask,
    gather_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    slot_table,
    write_kv,
)

NUM_BLOCKS, BLOCK, NKV, NH, HD = 64, 4, 2, 6, 16


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [q_len, NH, HD] at positions [start, start + q_len); k, v [start + q_len, NKV, HD].
    The textbook form: K/V repeated per query head, explicit causal mask."""
    g = NH // NKV
    k = k.repeat_interleave(g, dim=1).transpose(0, 1)
    v = v.repeat_interleave(g, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1).float() @ k.float().transpose(1, 2) * HD**-0.5
    qpos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[1]) > qpos, float("-inf"))
    return (scores.softmax(-1) @ v.float()).transpose(0, 1)


def random_sequences(lengths: list[int], dtype: torch.dtype, seed: int):
    """Fill a paged cache with K/V of sequences of `lengths`, on random non-contiguous blocks."""
    g = torch.Generator().manual_seed(seed)
    # Non-zero junk everywhere, so an unmasked padding slot would change the result.
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, NKV, HD, generator=g).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, NKV, HD, generator=g).to(dtype)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    seqs = []
    for n in lengths:
        nb = -(-n // BLOCK)
        blocks, perm = perm[:nb], perm[nb:]
        k = torch.randn(n, NKV, HD, generator=g).to(dtype)
        v = torch.randn(n, NKV, HD, generator=g).to(dtype)
        table = torch.tensor(blocks)
        slots = slot_table(table.unsqueeze(0), BLOCK)[0, :n]
        write_kv(k_cache, v_cache, k, v, slots)
        seqs.append((table, k, v))
    return k_cache, v_cache, seqs


def test_write_kv_places_tokens_by_slot():
    k_cache, v_cache, seqs = random_sequences([7, 1, 13], torch.float32, 0)
    for table, k, v in seqs:
        for pos in range(k.shape[0]):
            block, off = table[pos // BLOCK].item(), pos % BLOCK
            assert torch.equal(k_cache[block, off], k[pos]) and torch.equal(v_cache[block, off], v[pos])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_matches_dense(dtype, tol):
    lengths = [1, 5, 17, 8, 30]
    k_cache, v_cache, seqs = random_sequences(lengths, dtype, 1)
    q = torch.randn(len(lengths), NH, HD).to(dtype)
    max_len = max(lengths)
    nblk = -(-max_len // BLOCK)
    # Pad tables with a block full of junk: the mask must hide it.
    tables = torch.stack([torch.cat([t, torch.full((nblk - len(t),), 63)]) for t, _, _ in seqs])
    for mask_dtype in (None, dtype):  # boolean and additive masks
        mask = decode_mask(torch.tensor(lengths), nblk * BLOCK, mask_dtype)
        out = paged_decode_attention(q, k_cache, v_cache, tables, mask, HD**-0.5)
        for i, (n, (_, k, v)) in enumerate(zip(lengths, seqs)):
            ref = dense_attention(q[i : i + 1], k, v, n - 1)[0]
            torch.testing.assert_close(out[i].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_decode_padding_reads_nothing(poison):
    """Every block no sequence owns holds NaN or inf (stale K/V of another request), and so do
    the padding block's neighbours: the outputs stay finite and equal the dense reference.
    The tables are padded with a zeroed block, and the unwritten tail of each sequence's last
    block is zero, as the runner leaves every block it hands out."""
    lengths = [1, 5, 17, 8, 30]
    k_cache, v_cache, seqs = random_sequences(lengths, torch.float32, 4)
    used = {b for table, _, _ in seqs for b in table.tolist()}
    pad_block = next(b for b in range(NUM_BLOCKS) if b not in used)
    owned = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    for n, (table, _, _) in zip(lengths, seqs):
        owned[slot_table(table.unsqueeze(0), BLOCK)[0, :n]] = True
    in_owned_block = torch.zeros(NUM_BLOCKS, dtype=torch.bool)
    in_owned_block[list(used)] = True
    in_owned_block = in_owned_block.repeat_interleave(BLOCK)
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, NKV, HD)
        flat[~in_owned_block] = poison
        flat[in_owned_block & ~owned] = 0.0  # zeroed when handed out, not written since
        cache[pad_block] = 0.0
    q = torch.randn(len(lengths), NH, HD, generator=torch.Generator().manual_seed(5))
    nblk = -(-max(lengths) // BLOCK)
    tables = torch.stack([torch.cat([t, torch.full((nblk - len(t),), pad_block)]) for t, _, _ in seqs])
    for mask_dtype in (None, torch.float32):
        mask = decode_mask(torch.tensor(lengths), nblk * BLOCK, mask_dtype)
        out = paged_decode_attention(q, k_cache, v_cache, tables, mask, HD**-0.5)
        assert torch.isfinite(out).all()
        for i, (n, (_, k, v)) in enumerate(zip(lengths, seqs)):
            torch.testing.assert_close(out[i], dense_attention(q[i : i + 1], k, v, n - 1)[0], atol=1e-5, rtol=1e-5)


def test_gather_blocks_is_the_slot_gather():
    k_cache, _, seqs = random_sequences([7, 19], torch.float32, 6)
    width = max(len(t) for t, _, _ in seqs)
    tables = torch.stack([torch.cat([t, t[:1].repeat(width - len(t))]) for t, _, _ in seqs])
    slots = slot_table(tables, BLOCK)
    flat = k_cache.view(-1, NKV, HD)
    assert torch.equal(gather_blocks(k_cache, tables), flat[slots.reshape(-1)].view(*slots.shape, NKV, HD))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("start,q_len", [(0, 9), (0, 1), (8, 5), (5, 11), (12, 1)])
def test_prefill_chunk_matches_dense(dtype, tol, start, q_len):
    n = start + q_len
    k_cache, v_cache, seqs = random_sequences([23, n], dtype, 2)
    table, k, v = seqs[1]
    q = torch.randn(q_len, NH, HD).to(dtype)
    out = paged_prefill_attention(q, k_cache, v_cache, table, start, HD**-0.5)
    ref = dense_attention(q, k, v, start)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_prefill_equals_full_causal_attention_rows():
    """Chunks computed one after another give the rows of one full causal pass."""
    k_cache, v_cache, seqs = random_sequences([20], torch.float32, 3)
    table, k, v = seqs[0]
    q = torch.randn(20, NH, HD)
    full = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(NH // NKV, 1).transpose(0, 1),
        v.repeat_interleave(NH // NKV, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    chunks = [
        paged_prefill_attention(q[s:e], k_cache, v_cache, table, s, HD**-0.5) for s, e in ((0, 6), (6, 7), (7, 20))
    ]
    torch.testing.assert_close(torch.cat(chunks), full, atol=1e-5, rtol=1e-5)
