"""ops.use binds a backend for its own context only (a thread, a task), nested blocks restore
the outer binding, and each backend states its device choices (graphs, argmax, launch mode)."""

import inspect
import threading

import pytest
import torch

from frugal import ops
from frugal.ops import torch_ref


class Marked:
    """A fake backend whose rms_norm says which backend ran it."""

    def __init__(self, mark: str) -> None:
        self.mark = mark

    def rms_norm(self, x, weight, eps):
        return self.mark


def test_ops_take_the_reference_signature_and_run_it_by_default():
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    assert inspect.signature(ops.rms_norm) == inspect.signature(torch_ref.rms_norm)
    assert ops.current() is torch_ref
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), torch_ref.rms_norm(x, w, 1e-5))


def test_nested_use_restores_the_outer_backend():
    with ops.use(Marked("outer")):
        with ops.use(Marked("inner")):
            assert ops.rms_norm(None, None, 0.0) == "inner"
        assert ops.rms_norm(None, None, 0.0) == "outer"
    assert ops.current() is torch_ref


def test_two_threads_keep_their_own_backends():
    """Both threads sit inside their own ops.use at once; each sees only its own."""
    seen, both_bound = {}, threading.Barrier(2)

    def run(mark: str) -> None:
        with ops.use(Marked(mark)):
            both_bound.wait(timeout=10)
            seen[mark] = ops.rms_norm(None, None, 0.0)
            both_bound.wait(timeout=10)

    threads = [threading.Thread(target=run, args=(m,)) for m in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "a", "b": "b"}
    assert ops.current() is torch_ref


def test_torch_ref_device_choices():
    assert torch_ref.CUDA_GRAPHS is False and torch_ref.argmax is None
    torch_ref.configure({"int4"})  # (nothing to set)


def test_triton_device_choices():
    pytest.importorskip("triton")
    tri = ops.load("triton")
    from frugal.ops.triton import launch, sampling

    assert tri.CUDA_GRAPHS is True and tri.argmax is sampling.argmax
    saved = launch._default[0]
    try:
        tri.configure({"fp8"})
        assert launch._default[0] == "wait"
        tri.configure(set())
        assert launch._default[0] == "trigger"
    finally:
        launch._default[0] = saved
