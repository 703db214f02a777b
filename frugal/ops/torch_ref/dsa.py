"""DeepSeek Sparse Attention: the indexer's keys, its top-k, and MLA over the selected positions.

A selection is [num_tokens, k] int32: for each new token of the step, positions in its request's
context (0 = the first token), -1 for an unused place. Every valid position is one the token may
see (at most its own), and no position appears twice.

Index keys sit in the cache rows after the latent: [num_pages, page_size, 1, dim] in the
model's dtype, or FP8 (float8_e4m3fn) [.., dim + 16]: the key / its scale (amax / 448, one a
token), then the fp32 scale's 4 bytes (ops.torch_ref.kv_quant's row) and 12 of padding.
"""

from __future__ import annotations

import torch

from frugal.model_config import INDEX_SCALE_BYTES as SCALE_BYTES
from frugal.ops.torch_ref.kv_quant import quantize_rows
from frugal.ops.torch_ref.mla import latent_rows, store_rows


def store_index_key(key: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key: [num_tokens, dim] -> the index-key columns cache [num_pages, page_size, 1, dim (+ 16
    for FP8)] at the slots (a slot < 0: not stored)."""
    if cache.element_size() != 1:
        store_rows(key[:, None, :].to(cache.dtype), cache, slot_mapping)
        return
    row = torch.zeros(key.shape[0], 1, cache.shape[-1], dtype=torch.uint8, device=key.device)
    row[:, 0, :key.shape[1] + 4] = quantize_rows(key, cache.dtype).view(torch.uint8)
    store_rows(row.view(cache.dtype), cache, slot_mapping)


def index_key_rows(keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The index keys at slots: [len(slots), dim] fp32 (FP8 times its scale)."""
    rows = keys.view(-1, keys.shape[-1])
    if keys.element_size() != 1:
        return rows.index_select(0, slots).float()
    picked = rows.view(torch.uint8).index_select(0, slots)
    dim = keys.shape[-1] - SCALE_BYTES
    scale = picked[:, dim:dim + 4].contiguous().view(torch.float32)  # [n, 1]
    return picked[:, :dim].view(keys.dtype).float() * scale


def index_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
               topk: int, max_seq_len: int, bound: bool = False) -> torch.Tensor:
    """Each new token's top-k positions by index score sum_h weights[t, h] * ReLU(q[t, h] .
    key(s)) over the positions s it can see (the request's first seq_len - num_new + i + 1).

    q: [num_tokens, heads, dim]; weights: [num_tokens, heads] fp32 (scales folded in); keys:
    the cache's index-key columns (see the module docstring; a column view is fine); the batch
    layout as paged_attention's. Returns [num_tokens, min(topk, max_seq_len)] int32, scores
    computed in fp32, -1 where a token sees fewer positions. bound: max_seq_len only bounds
    the contexts, far past them maybe (a CUDA graph's step); the result is the same."""
    k = min(topk, max_seq_len)
    out = torch.full((q.shape[0], k), -1, dtype=torch.int32, device=q.device)
    page_size = keys.shape[1]
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, length in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e == s or length == 0:
            continue
        pos = torch.arange(length, device=q.device)
        slots = page_table[b].long()[pos // page_size] * page_size + pos % page_size
        key = index_key_rows(keys, slots)  # [L, dim]
        per_head = torch.relu(torch.einsum("thd,ld->thl", q[s:e].float(), key))
        score = (per_head * weights[s:e, :, None]).sum(dim=1)  # [n, L]
        q_pos = length - (e - s) + torch.arange(e - s, device=q.device)
        score = score.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        values, picked = score.topk(min(k, length), dim=-1)
        out[s:e, :picked.shape[1]] = torch.where(values == float("-inf"), -1, picked).int()
    return out


def sparse_mla_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, selection: torch.Tensor, scale: float,
                         kv_lora_rank: int, kv_scales: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """mla_attention with each token attending to its selection's positions only.

    q: [num_tokens, num_heads, width] absorbed queries; cache: [num_pages, page_size, 1, width]
    ([latent | rotary key] rows; a column view is fine; FP8 with kv_scales as mla_attention's);
    selection: [num_tokens, k] int32 (see the module docstring). Returns [num_tokens, num_heads,
    kv_lora_rank] in q's dtype, computed in fp32 (zeros for a token that selects nothing)."""
    num_tokens, k = selection.shape
    page_size = cache.shape[1]
    counts = cu_seqlens_q.diff().long()
    request = torch.repeat_interleave(torch.arange(counts.shape[0], device=q.device), counts,
                                      output_size=num_tokens)
    ok = selection >= 0
    pos = selection.long().clamp(min=0)  # (-1 reads position 0, always written, masked below)
    slots = page_table.long()[request[:, None], pos // page_size] * page_size + pos % page_size
    rows = latent_rows(cache, slots.flatten(), kv_scales).view(num_tokens, k, -1)
    scores = torch.einsum("thw,tkw->thk", q.float(), rows) * scale
    probs = torch.softmax(scores.masked_fill(~ok[:, None, :], float("-inf")), dim=-1)
    out = torch.einsum("thk,tkc->thc", probs.nan_to_num(0.0), rows[..., :kv_lora_rank])
    return out.to(q.dtype)
