"""The flattened batch of a step (engine.step_inputs.prepare)."""

from frugal.core.page_allocator import PageRef
from frugal.core.page_table import PageTable
from frugal.core.scheduler import SchedulerOutput
from frugal.request import Request, SamplingParams
from frugal.worker.step_inputs import prepare


def request(prompt_len: int, computed: int, first_page: int) -> Request:
    r = Request(f"r{first_page}", None, list(range(1, prompt_len + 1)), SamplingParams(),
                max_total_tokens=prompt_len + 8)
    r.num_computed_tokens = computed
    r.page_table = PageTable(PageRef(first_page + i, 0) for i in range(-(-prompt_len // 4)))
    return r


def test_leading_decodes_are_counted_for_the_decode_kernel():
    decode_a, decode_b = request(9, 8, 0), request(5, 4, 10)
    chunk, late_decode = request(12, 4, 20), request(7, 6, 30)
    out = SchedulerOutput([decode_a, decode_b, chunk, late_decode], [1, 1, 8, 1])
    inputs = prepare(out, page_size=4, device="cpu")
    assert inputs.meta.num_decodes == 2  # the decode after the chunk runs with the chunk
    assert inputs.meta.max_query_len == 8 and not inputs.decode
    assert inputs.cu_seqlens == [0, 1, 2, 10, 11]
    only_decodes = SchedulerOutput([decode_a, decode_b], [1, 1])
    assert prepare(only_decodes, page_size=4, device="cpu").meta.num_decodes == 2
    prompt_first = SchedulerOutput([chunk, decode_a], [8, 1])
    assert prepare(prompt_first, page_size=4, device="cpu").meta.num_decodes == 0


def test_every_field_starts_16_byte_aligned_and_holds_its_values():
    """Kernels get each field 16-byte aligned whatever the batch's sizes (a field at another
    alignment would compile another kernel variant in the middle of serving)."""
    import torch

    from frugal.worker.step_inputs import Pending

    for sizes in ([1], [3, 1], [5, 1, 1], [2, 7, 1, 1, 3]):
        requests = [request(9 + n, 9, 10 * i) for i, n in enumerate(sizes)]
        for i, r in enumerate(requests):
            r.page_table = PageTable([*(PageRef(10 * i + k, 0) for k in range(1 + i)),
                                      *r.page_table])
        pending = requests[-1]
        pending.num_pending = 1
        pending.num_computed_tokens = pending.num_tokens  # its next input is still on the device
        out = SchedulerOutput(requests, [n if r is not pending else 1
                                         for r, n in zip(requests, sizes)])
        tokens = torch.tensor([77])
        inputs = prepare(out, page_size=4, device="cpu", pending=Pending(tokens, {pending: 0}),
                         check=True, tag_updates={3: 9, 5: 11})
        meta = inputs.meta
        fields = [inputs.input_ids, inputs.positions, inputs.logits_indices, meta.slot_mapping,
                  meta.page_table, meta.cu_seqlens_q, meta.seq_lens, inputs.page_tags,
                  *inputs.tag_updates]
        assert all(f.data_ptr() % 16 == 0 for f in fields)
        assert meta.seq_lens.tolist() == [r.num_computed_tokens + n
                                          for r, n in zip(requests, out.num_new_tokens)]
        assert meta.page_table.tolist() == [[p for p, _ in r.page_table]
                                            + [0] * (meta.page_table.shape[1] - len(r.page_table))
                                            for r in requests]
        assert inputs.page_tags.eq(0).all() and inputs.tables[0].equal(meta.page_table)
        assert inputs.input_ids[-1].item() == 77  # the pending token, gathered
        assert inputs.tag_updates[0].tolist() == [3, 5]
        assert inputs.tag_updates[1].tolist() == [9, 11]
