"""The flattened batch of a step (engine.step_inputs.prepare)."""

from frugal.engine.scheduler import SchedulerOutput
from frugal.engine.step_inputs import prepare
from frugal.request import Request, SamplingParams


def request(prompt_len: int, computed: int, first_page: int) -> Request:
    r = Request(f"r{first_page}", None, list(range(1, prompt_len + 1)), SamplingParams(),
                max_total_tokens=prompt_len + 8)
    r.num_computed_tokens = computed
    r.page_table = [(first_page + i, 0) for i in range(-(-prompt_len // 4))]
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
