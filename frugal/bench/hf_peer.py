"""HF transformers `generate` as the peer in `frugal bench offline --peer hf`: the same checkpoint,
or random weights of the same shape for `--load-format dummy`."""

from __future__ import annotations

import time

import torch

from frugal.bench.result import Result
from frugal.loader import load_transformers_model


class HFPeer:
    """Static-batch `generate` (all prompts the same length, so no padding)."""

    def __init__(self, model: str | None, load_format: str, device: str,
                 dtype: torch.dtype) -> None:
        self.model = load_transformers_model(model, device, dtype, load_format)
        self.device = device

    def _generate(self, ids: torch.Tensor, n: int) -> float:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, pad_token_id=0)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    @torch.inference_mode()
    def measure(self, prompts: list[list[int]], output_len: int) -> Result:
        ids = torch.tensor(prompts, device=self.device)
        c, n_in = ids.shape
        first = self._generate(ids, 1)  # prefill + one token
        total = self._generate(ids, output_len)
        decode = max(total - first, 1e-9)
        itl = decode / max(output_len - 1, 1)
        return Result(system="transformers", concurrency=c, prompt_tok_s=c * n_in / first,
                      gen_tok_s=c * (output_len - 1) / decode, output_tok_s=c * output_len / total,
                      ttft_ms=1e3 * first, itl_ms=1e3 * itl, itl_p99_ms=float("nan"),
                      decode_itl_ms=1e3 * itl)
