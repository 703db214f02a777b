"""MLA prompt attention, expanded: the step's prompt requests attend as plain multi-head attention.

Decode rows attend absorbed (one latent row read for every head: ops.mla_attention), but a prompt
chunk has many query rows per cached row, and there absorption costs (kv_lora_rank + rope) +
kv_lora_rank products a (query, key) pair and head against (nope + rope) + v without it: 1088
against 320 at DeepSeek-V3's shapes. So, as vLLM and SGLang do, the prompt requests' contexts are
gathered from the paged latent cache in one batch (no loop over requests), up-projected by
kv_b_proj into per-head keys [k_nope | k_rope] and values, laid out page by page, and attended by
ops.paged_attention (one program per request, head and block of new tokens, causal).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from frugal import ops
from frugal.layers.attention import AttentionMetadata
from frugal.ops.torch_ref.mla import latent_rows

PAGE = 16  # tokens a page of the expanded keys and values
BUDGET_BYTES = 1 << 30  # expanded keys and values of one step at most (else: absorbed)


def fits(meta: AttentionMetadata, num_heads: int, key_dim: int, kv_dim: int, latent_width: int,
         dtype: torch.dtype) -> bool:
    """Whether the step's prompt requests (after its num_decodes decodes) have room to expand
    (host values only): what attend allocates for their contexts, each bounded by max_seq_len
    rounded up to a page, within BUDGET_BYTES. A context row takes keys and values (key_dim
    wide each) and the up-projection (kv_dim = nope + v) a head, and its latent row in fp32 and
    in dtype."""
    prompts = meta.seq_lens.shape[0] - meta.num_decodes
    rows = prompts * (-(-meta.max_seq_len // PAGE) * PAGE)
    row_bytes = (num_heads * (2 * key_dim + kv_dim) * dtype.itemsize
                 + latent_width * (4 + dtype.itemsize) + 32)
    return prompts > 0 and meta.max_query_len > 1 and rows * row_bytes <= BUDGET_BYTES


class Context(NamedTuple):
    """Where a step's prompt requests' context rows come from and go, the same for each layer:
    slots [total] int64, the cache slot of each expanded row (request by request, each padded to
    a PAGE); pages [requests, width] int32, each request's pages of expanded rows; cu
    [requests + 1] int32 and seq_lens [requests] int32, their new tokens and contexts."""

    slots: torch.Tensor
    pages: torch.Tensor
    cu: torch.Tensor
    seq_lens: torch.Tensor


# the last step's Context, computed by its first MLA layer and reused by the others: a step's
# metadata is not written after it is built (eager steps; captured ones never expand)
_last: tuple[weakref.ref | None, int, Context | None] = (None, 0, None)


def context(meta: AttentionMetadata, page_size: int, device: torch.device) -> Context:
    """The step's Context (computed once a step: ~35 small ops a layer otherwise, on the host
    of every prompt step)."""
    global _last
    ref, size, known = _last
    if ref is not None and ref() is meta and size == page_size:
        return known
    first = meta.num_decodes
    seq_lens = meta.seq_lens[first:].long()
    # every context position of every prompt request, request by request (the sizes from the
    # host's lengths where the step has them: no sync)
    num_pages = -(-seq_lens // PAGE)
    host = None if meta.host_seq_lens is None else [-(-n // PAGE)
                                                    for n in meta.host_seq_lens[first:]]
    total = (sum(host) if host else int(num_pages.sum())) * PAGE
    request = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=device),
                                      num_pages * PAGE, output_size=total)
    starts = (torch.cumsum(num_pages, 0) - num_pages) * PAGE  # each request's first row
    pos = torch.arange(total, device=device) - starts[request]
    # padding rows read position 0 (always written, so finite); attention never weighs them
    pos = torch.where(pos < seq_lens[request], pos, 0)
    table = meta.page_table[first:].long()
    slots = table[request, pos // page_size] * page_size + pos % page_size
    width = max(host) if host else int(num_pages.max())
    columns = torch.arange(width, device=device)
    pages = (starts // PAGE)[:, None] + columns
    pages = torch.where(columns < num_pages[:, None], pages, 0).int()
    cu = meta.cu_seqlens_q[first:] - meta.cu_seqlens_q[first]
    # (a copy of the lengths: a slice's pointer, 16-byte aligned or not, would compile the
    # Triton kernel once more for each alignment)
    known = Context(slots, pages, cu, meta.seq_lens[first:].clone())
    _last = (weakref.ref(meta), page_size, known)
    return known


def attend(q: torch.Tensor, cache: torch.Tensor, kv_scales: torch.Tensor | None,
           w_kv: torch.Tensor, kv_lora_rank: int, v_head_dim: int, scale: float,
           meta: AttentionMetadata) -> torch.Tensor:
    """The prompt requests' rows: requests num_decodes.. of meta, their new tokens' queries q
    [num_tokens, heads, nope + rope] (not absorbed: the rope part rotated); cache the latent
    rows [num_pages, page_size, 1, kv_lora_rank + rope (+ 4: rows with a scale)] with these
    tokens stored; w_kv [heads, nope + v_head_dim, kv_lora_rank] (kv_b_proj). Returns
    [num_tokens, heads, v_head_dim] in q's dtype."""
    heads, key_dim = q.shape[1], q.shape[2]
    nope = w_kv.shape[1] - v_head_dim
    c = context(meta, cache.shape[1], q.device)
    total = c.slots.shape[0]
    rows = latent_rows(cache, c.slots, kv_scales).to(q.dtype)  # [total, lora + rope]
    kv = torch.einsum("sc,hdc->shd", rows[:, :kv_lora_rank], w_kv)  # [total, heads, nope + v]
    keys = torch.empty(total, heads, key_dim, dtype=q.dtype, device=q.device)
    keys[..., :nope] = kv[..., :nope]
    keys[..., nope:] = rows[:, None, kv_lora_rank:]
    values = torch.zeros(total, heads, key_dim, dtype=q.dtype, device=q.device)
    values[..., :v_head_dim] = kv[..., nope:]
    out = ops.paged_attention(q, keys.view(-1, PAGE, heads, key_dim),
                              values.view(-1, PAGE, heads, key_dim), c.pages, c.cu, c.seq_lens,
                              scale, meta.max_query_len, meta.max_seq_len)
    return out[..., :v_head_dim]
