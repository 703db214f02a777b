"""A whole model on the Triton ops equals the torch_ref ops: tiny random Qwen3 (GQA, qk-norm)
in Triton's interpreter on CPU, greedy tokens and logits."""

import pytest
import torch

from frugal import LLM, SamplingParams
from tests.loader.test_hf_dir import write_model
from tests.models.test_llama_vs_hf import frugal_logits

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_backend_matches_torch_ref(tmp_path):
    write_model("qwen3-qk-norm-head-dim", tmp_path)
    kwargs = dict(dtype="float32", device=DEVICE, kv_cache_memory="8MiB", page_size=16)
    ref = LLM(str(tmp_path), ops_backend="torch_ref", **kwargs)
    tri = LLM(str(tmp_path), ops_backend="triton", **kwargs)
    ids = torch.randint(0, 320, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    torch.testing.assert_close(frugal_logits(tri, ids), frugal_logits(ref, ids), atol=1e-3,
                               rtol=1e-3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [ids, ids[:20], ids[5:30]]  # prefill batch, then batched decode
    assert ([o.outputs[0].token_ids for o in tri.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])
