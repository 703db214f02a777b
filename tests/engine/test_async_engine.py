"""The engine thread: outputs reach asyncio callers; a stopped engine leaves none hanging."""

import asyncio

import pytest

from frugal import SamplingParams
from frugal.engine.async_engine import AsyncEngine, EngineDeadError


def test_generate_then_shutdown(llm):
    engine = AsyncEngine(llm.engine)
    engine.start()

    async def run():
        outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=4,
                                                                           ignore_eos=True), "a")]
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    engine.shutdown()
    assert not engine.alive

    async def after():
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([1, 2], SamplingParams(max_tokens=2), "b"):
                pass

    asyncio.run(asyncio.wait_for(after(), timeout=10))
    assert not llm.engine.has_unfinished_requests()


def test_rejected_add_is_raised_to_the_caller(llm):
    engine = AsyncEngine(llm.engine)
    engine.start()

    async def run():
        async for _ in engine.generate([1, 2], SamplingParams(stop_token_ids=[10**7]), "c"):
            pass

    with pytest.raises(ValueError, match="stop_token_ids"):
        asyncio.run(asyncio.wait_for(run(), timeout=10))
    engine.shutdown()
