"""Turn a scheduled step into the model's input tensors with one or two host-to-device copies."""

from __future__ import annotations

import array
import functools
from dataclasses import dataclass

import torch

from frugal.core.scheduler import SchedulerOutput
from frugal.layers.attention import AttentionMetadata
from frugal.request import Request


@dataclass
class StepInputs:
    """One step's model inputs, on the model's device.

    input_ids, positions: [num_tokens] int64; logits_indices: [num_sampled] int64, the rows of the
    hidden states to sample from (the last new token of each request whose computed tokens reach
    its num_tokens). sampled: indices into SchedulerOutput.requests that sample this step.
    cu_seqlens: host copy of meta.cu_seqlens_q. decode: every request has one new token.
    page_tags: [num_requests, max_pages] int32, the tag each page-table entry had when its
    request got the page (None when the step runs no integrity check); tag_updates: (page ids
    int64, new tags int32) of pages handed out since the last step, or None; tables: with
    page_tags, both in one tensor [2, num_requests, max_pages] (page_table, page_tags), for a
    single copy.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[int]
    cu_seqlens: list[int]
    decode: bool
    page_tags: torch.Tensor | None = None
    tag_updates: tuple[torch.Tensor, torch.Tensor] | None = None
    tables: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return len(self.cu_seqlens) - 1


@dataclass
class Pending:
    """Tokens sampled by a step still in flight: tokens [n] int64 on the device, and index[r] the
    row of request r's token in it."""

    tokens: torch.Tensor
    index: dict[Request, int]


def prepare(out: SchedulerOutput, page_size: int, device: str, pending: Pending | None = None,
            check: bool = False, tag_updates: dict[int, int] | None = None) -> StepInputs:
    """Flatten the scheduled requests' new tokens into one batch.

    pending: the tokens of the step still in flight, for a step launched before they reached the
    host: a request's pending token (request.num_pending, position num_tokens) is gathered from
    them on the device.

    check: also upload each entry's expected tag (for ops.check_kv_pages); tag_updates: page ->
    new tag, uploaded in the same buffers for the runner to apply to the pool's tags.

    The int64 fields travel in one pinned buffer and the int32 fields in another, each copied
    without blocking the host; nothing here waits for the device.
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    gather_to: list[int] = []  # rows of input_ids taken from pending.tokens ...
    gather_from: list[int] = []  # ... at these rows
    cu_seqlens, seq_lens, logits_indices, sampled = [0], [], [], []
    width = max(len(r.page_table) for r in out.requests)
    # page ids, then (check) expected tags, each request's row padded to width, as int32; the
    # tags start 16-byte aligned (at `seg`)
    seg = -(-len(out.requests) * width // 4) * 4
    tables = array.array("i")
    for part, name in enumerate(("ids", "tags") if check else ("ids",)):
        for r in out.requests:
            tables.extend(getattr(r.page_table, name))  # a memcpy, however long the request
            tables.extend(_zeros(width - len(r.page_table)))
        tables.extend(_zeros(seg * (part + 1) - len(tables)))
    updates = tag_updates or {}
    for i, (request, n) in enumerate(zip(out.requests, out.num_new_tokens)):
        start = request.num_computed_tokens
        end = start + n
        known = request.num_tokens
        table = request.page_table.ids
        ids += request.token_ids(start, min(end, known))
        if end > known:  # the pending token (only ever the last new one)
            if pending is None or request not in pending.index or end != known + 1:
                raise ValueError(f"request {request.request_id}: its token at position {known} "
                                 "is not known yet")
            gather_to.append(len(ids))
            gather_from.append(pending.index[request])
            ids.append(0)
        positions += range(start, end)
        slots += [table[p // page_size] * page_size + p % page_size
                  for p in range(start, end)]
        cu_seqlens.append(cu_seqlens[-1] + n)
        seq_lens.append(end)
        if end == request.num_tokens_with_pending:
            logits_indices.append(cu_seqlens[-1] - 1)
            sampled.append(i)
    num_tokens, num_requests = len(positions), len(seq_lens)
    # requests at the front with one new token each (all of them: a decode step)
    num_decodes = next((i for i, n in enumerate(out.num_new_tokens) if n != 1), num_requests)
    decode = num_decodes == num_requests
    num_logits, num_gathered = len(logits_indices), len(gather_to)
    # every field starts 16-byte aligned: the kernels are compiled for aligned pointers once,
    # not again for each alignment a batch's sizes would give its fields
    longs, (ids_at, pos_at, slots_at, logits_at, to_at, from_at, keys_at) = _packed(
        [ids, positions, slots, logits_indices, gather_to, gather_from, list(updates)], 2,
        torch.int64, device)
    ints, (cu_at, lens_at, tables_at, values_at) = _packed(
        [cu_seqlens, seq_lens, tables, list(updates.values())], 4, torch.int32, device)
    meta = AttentionMetadata(
        slot_mapping=longs[slots_at:slots_at + num_tokens],
        page_table=ints[tables_at:tables_at + num_requests * width].view(num_requests, width),
        cu_seqlens_q=ints[cu_at:cu_at + num_requests + 1],
        seq_lens=ints[lens_at:lens_at + num_requests],
        max_query_len=max(out.num_new_tokens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        host_seq_lens=tuple(seq_lens),
        fresh_kv=not any(r.params.prompt_from_cache for r in out.requests),
    )
    input_ids = longs[ids_at:ids_at + num_tokens]
    if num_gathered:
        to, src = longs[to_at:to_at + num_gathered], longs[from_at:from_at + num_gathered]
        if gather_to == list(range(num_tokens)) and gather_from == list(range(len(pending.tokens))):
            input_ids = pending.tokens  # a decode step of the same requests: as they are
        else:
            input_ids.index_copy_(0, to, pending.tokens.index_select(0, src))
    inputs = StepInputs(input_ids, longs[pos_at:pos_at + num_tokens], meta,
                        longs[logits_at:logits_at + num_logits], sampled, cu_seqlens, decode)
    if check:
        both = ints[tables_at:tables_at + 2 * seg].view(2, seg)[:, :num_requests * width]
        inputs.tables = both.view(2, num_requests, width)
        inputs.page_tags = inputs.tables[1]
    if updates:
        inputs.tag_updates = (longs[keys_at:keys_at + len(updates)],
                              ints[values_at:values_at + len(updates)])
    return inputs


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q", torch.float32: "f"}


def _packed(fields: list, align: int, dtype: torch.dtype, device: str | torch.device
            ) -> tuple[torch.Tensor, list[int]]:
    """The fields (lists or arrays of ints) back to back in one uploaded tensor, each starting at
    a multiple of `align` elements; returns the tensor and each field's start."""
    values = array.array(_ARRAY_CODES[dtype])
    starts = []
    for field in fields:
        values.extend(_zeros(-len(values) % align))
        starts.append(len(values))
        values.extend(field)
    return upload(values, dtype, device), starts


@functools.lru_cache(maxsize=64)
def _zeros(n: int) -> tuple[int, ...]:
    return (0,) * n


def upload(values: list | array.array, dtype: torch.dtype, device: str | torch.device
           ) -> torch.Tensor:
    """values as a 1-D tensor on `device`, copied from pinned memory without waiting (unlike
    torch.tensor(values, device=...), which waits for the device to finish its queue). Built
    through array.array: the ~50k ints of 64 requests' page tables convert ~3.5x faster than
    with torch.tensor, and this runs on the host before every step."""
    if not isinstance(values, array.array):
        values = array.array(_ARRAY_CODES[dtype], values)
    host = torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)
    if torch.device(device).type == "cpu":
        return host
    pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)
