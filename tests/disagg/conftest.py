"""Fixtures of the disaggregation tests, shared by their modules: two engines over NIXL
(engine-level tests), and a `frugal serve-pd` deployment with its neighbours (router-level)."""

import pytest

from tests.disagg.deployment import system  # noqa: F401  (the package-wide deployment)
from tests.disagg.engines import config
from tests.disagg.pools import start_peer


@pytest.fixture(scope="package", params=["auto", "nixl"], ids=["mapped", "nixl"])
def engines(request):
    """(prefill, decode) engines; the decode engine reads through the prefill pool mapped into
    it (disagg.direct: one process on a CPU) or through NIXL, each engine-level test once
    with each."""
    pytest.importorskip("nixl_cu13")
    from frugal.engine.llm_engine import LLMEngine

    return (LLMEngine(config(kv_role="prefill", kv_lease_s=30.0)),
            LLMEngine(config(kv_role="decode", kv_transport=request.param)))


@pytest.fixture(scope="package")
def pool_peer():
    """(description, checksums of each page) of a shareable pool in another process."""
    child, pipe, desc, sums = start_peer()
    yield desc, sums
    pipe.send("done")
    child.join(10)
