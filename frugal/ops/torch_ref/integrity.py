"""The KV-cache integrity check: do a step's page tables still point at the pages they were given?

Every physical page carries a tag that changes whenever the page is handed out (see
core.page_allocator); a request's page table holds the tag each page had when it got it. A
stale entry (the page freed and handed out again, the entry overwritten, a page freed twice) shows
as a tag mismatch. The check runs as its own op before a step's layers, so it never races the
attention kernels, and masks a failing request there and then: its new K/V is not stored and its
attention reads nothing, so no other request's pages are touched and its own output is discarded
by the host, which aborts it when it reads the step's status.
"""

from __future__ import annotations

import torch

STATUS_FIELDS = 4  # failed (0/1), page id, expected tag, found tag (of the first stale entry)


def check_kv_pages(page_table: torch.Tensor, expected_tags: torch.Tensor, tags: torch.Tensor,
                   seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   slot_mapping: torch.Tensor, page_size: int,
                   status: torch.Tensor | None = None) -> torch.Tensor:
    """Compare each request's expected tags with its pages' tags; mask failing requests.

    page_table, expected_tags: [num_requests, max_pages] int32 (entries past a request's
    ceil(seq_len / page_size) pages are ignored); tags: [num_pages] int32, every page's current
    tag; seq_lens: [num_requests] int32; cu_seqlens_q: [num_requests + 1] int32;
    slot_mapping: [num_tokens] int64. Returns status [num_requests, 4] int32: (1, page, expected,
    found) for the first stale entry of a failing request, zeros for one that passes. A failing
    request gets seq_lens 0 and its slots -1, in place. status: where to write it (a captured
    graph's static buffer), else a new tensor.
    """
    num_requests, width = page_table.shape
    if status is None:
        status = torch.zeros(num_requests, STATUS_FIELDS, dtype=torch.int32, device=tags.device)
    else:
        status.zero_()
    if num_requests == 0 or width == 0:
        return status
    num_pages = (seq_lens.long() + page_size - 1) // page_size
    live = torch.arange(width, device=tags.device)[None, :] < num_pages[:, None]
    pages = torch.where(live, page_table, 0).long()
    found = tags[pages]
    stale = live & (found != expected_tags)
    failed = stale.any(1)
    if not bool(failed.any()):
        return status
    first = stale.int().argmax(1, keepdim=True)
    status[:, 0] = failed.int()
    status[:, 1] = page_table.gather(1, first)[:, 0]
    status[:, 2] = expected_tags.gather(1, first)[:, 0]
    status[:, 3] = found.gather(1, first)[:, 0].int()
    status[~failed] = 0
    starts, ends = cu_seqlens_q[:-1].long(), cu_seqlens_q[1:].long()
    tokens = torch.arange(slot_mapping.shape[0], device=tags.device)
    owner_failed = ((tokens[None, :] >= starts[:, None]) & (tokens[None, :] < ends[:, None])
                    & failed[:, None]).any(0)
    slot_mapping.masked_fill_(owner_failed, -1)
    seq_lens.masked_fill_(failed, 0)
    return status
