"""DeepSeek Sparse Attention: the indexer's top-k and MLA over the selected positions alone.

A selection is [num_tokens, k] int32: for each new token of the step, positions in its request's
context (0 = the first token), -1 for an unused place. Every valid position is one the token may
see (at most its own), and no position appears twice.
"""

from __future__ import annotations

import torch


def index_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
               topk: int, max_seq_len: int) -> torch.Tensor:
    """Each new token's top-k positions by index score sum_h weights[t, h] * ReLU(q[t, h] .
    key(s)) over the positions s it can see (the request's first seq_len - num_new + i + 1).

    q: [num_tokens, heads, dim]; weights: [num_tokens, heads] fp32 (scales folded in); keys:
    [num_pages, page_size, 1, dim] (a column view of the cache rows is fine); the batch layout
    as paged_attention's. Returns [num_tokens, min(topk, max_seq_len)] int32, scores computed
    in fp32, -1 where a token sees fewer positions."""
    k = min(topk, max_seq_len)
    out = torch.full((q.shape[0], k), -1, dtype=torch.int32, device=q.device)
    page_size = keys.shape[1]
    rows = keys.view(-1, keys.shape[-1])
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, length in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        if e == s or length == 0:
            continue
        pos = torch.arange(length, device=q.device)
        slots = page_table[b].long()[pos // page_size] * page_size + pos % page_size
        key = rows.index_select(0, slots).float()  # [L, dim]
        per_head = torch.relu(torch.einsum("thd,ld->thl", q[s:e].float(), key))
        score = (per_head * weights[s:e, :, None]).sum(dim=1)  # [n, L]
        q_pos = length - (e - s) + torch.arange(e - s, device=q.device)
        score = score.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        values, picked = score.topk(min(k, length), dim=-1)
        out[s:e, :picked.shape[1]] = torch.where(values == float("-inf"), -1, picked).int()
    return out


def sparse_mla_attention(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, selection: torch.Tensor, scale: float,
                         kv_lora_rank: int) -> torch.Tensor:
    """mla_attention with each token attending to its selection's positions only.

    q: [num_tokens, num_heads, width] absorbed queries; cache: [num_pages, page_size, 1, width]
    ([latent | rotary key] rows; a column view is fine); selection: [num_tokens, k] int32 (see
    the module docstring). Returns [num_tokens, num_heads, kv_lora_rank] in q's dtype, computed
    in fp32 (zeros for a token that selects nothing)."""
    num_tokens, k = selection.shape
    page_size = cache.shape[1]
    counts = cu_seqlens_q.diff().long()
    request = torch.repeat_interleave(torch.arange(counts.shape[0], device=q.device), counts,
                                      output_size=num_tokens)
    ok = selection >= 0
    pos = selection.long().clamp(min=0)  # (-1 reads position 0, always written, masked below)
    slots = page_table.long()[request[:, None], pos // page_size] * page_size + pos % page_size
    rows = cache.view(-1, cache.shape[-1]).index_select(0, slots.flatten()).float()
    rows = rows.view(num_tokens, k, -1)  # [T, k, width]
    scores = torch.einsum("thw,tkw->thk", q.float(), rows) * scale
    probs = torch.softmax(scores.masked_fill(~ok[:, None, :], float("-inf")), dim=-1)
    out = torch.einsum("thk,tkc->thc", probs.nan_to_num(0.0), rows[..., :kv_lora_rank])
    return out.to(q.dtype)
