"""Fixtures of the disaggregation tests, shared by their modules: two engines over NIXL
(engine-level tests), and a `frugal serve-pd` deployment with its neighbours (router-level)."""

import pytest

from tests.disagg.deployment import system  # noqa: F401  (the package-wide deployment)
from tests.disagg.engines import config


@pytest.fixture(scope="package")
def engines():
    pytest.importorskip("nixl_cu13")
    from frugal.engine.llm_engine import LLMEngine

    return (LLMEngine(config(kv_role="prefill", kv_lease_s=30.0)),
            LLMEngine(config(kv_role="decode")))
