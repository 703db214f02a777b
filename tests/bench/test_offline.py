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
    free = engine.scheduler.num_free
    one = measure_engine(engine, prompts[:2], output_len=3)  # one batch, all at once
    assert one.concurrency == 2 and one.gen_tok_s > 0
    assert engine.scheduler.num_free == free  # no page kept by the finished requests


def test_plot_draws_one_line_per_results_file(tmp_path):
    import argparse
    import json
    from dataclasses import asdict

    from frugal.bench.offline import Result, run_plot

    paths = []
    for name, tok_s in (("bf16_kv", 100.0), ("fp8_kv", 150.0)):
        rows = [asdict(Result("frugal", c, 1.0, 1.0, tok_s * c, 1.0, 1.0, 1.0, 1.0,
                              bound_tok_s=2 * tok_s * c)) for c in (1, 8)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"workload": {"model": "m", "input_len": 8, "output_len": 4},
                                    "results": rows}))
        paths.append(str(path))
    png = tmp_path / "both.png"
    assert run_plot(argparse.Namespace(results=paths, plot=str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
