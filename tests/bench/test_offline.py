"""`frugal bench offline`'s measurement loop on the default model (CPU)."""

import math

from frugal.bench.offline import measure_engine, prompts_for


def test_closed_loop_keeps_concurrency_in_flight_until_every_prompt_is_done(llm):
    engine = llm.engine
    prompts = prompts_for(5, 12, engine.model_config.vocab_size, seed=0)
    r = measure_engine(engine, prompts, output_len=3, concurrency=2)
    assert r.concurrency == 2 and r.max_running == 2  # never more than 2 at once
    assert not engine.has_unfinished_requests()
    assert r.output_tok_s > 0 and r.ttft_ms > 0 and r.itl_ms > 0
    assert math.isnan(r.gen_tok_s)  # defined for one batch only
    free = engine.scheduler.kv.num_free
    one = measure_engine(engine, prompts[:2], output_len=3)  # one batch, all at once
    assert one.concurrency == 2 and one.gen_tok_s > 0
    assert engine.scheduler.kv.num_free == free  # no page kept by the finished requests
