"""Perplexity over fixed windows of text and, against a reference configuration, the statistics
llama.cpp reports for quantizations: KL divergence (mean, p99, max), top-1 agreement, RMS Δp.

The text is cut into back-to-back windows of ctx_len tokens; each window is one request and every
token but its first is scored. Both configurations score the very same windows, each token reading
the ones before it through the KV cache as a decode step does (SamplingParams.prompt_from_cache):
a quantized cache's effect shows at every position, not only past a prompt chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from frugal.llm import LLM
from frugal.request import SamplingParams


@dataclass
class PerplexityScore:
    num_windows: int
    num_tokens: int  # scored tokens
    ppl: float
    ref_ppl: float | None = None
    ppl_change_pct: float | None = None  # 100 * (ppl / ref_ppl - 1)
    kld_mean: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    top1_agree_pct: float | None = None
    rms_dp_pct: float | None = None  # RMS of p(token) differences, in percentage points


def windows(token_ids: list[int], ctx_len: int, max_windows: int | None) -> list[list[int]]:
    if ctx_len < 2:
        raise ValueError(f"ctx_len: must be >= 2, got {ctx_len}")
    count = len(token_ids) // ctx_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count < 1:
        raise ValueError(f"windows: no window of {ctx_len} tokens fits ({len(token_ids)} tokens, "
                         f"at most {max_windows} windows)")
    return [token_ids[i * ctx_len:(i + 1) * ctx_len] for i in range(count)]


def log_probs(llm: LLM, batch: list[list[int]], from_cache: bool = False) -> list[torch.Tensor]:
    """Per window: [ctx_len - 1, vocab] log-probabilities of tokens 1.., on the engine's device.
    from_cache: the window's tokens read one another through the KV cache, as decode steps do
    (SamplingParams.prompt_from_cache)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_tensor=True,
                            prompt_from_cache=from_cache)
    return [out.prompt_logprobs_tensor for out in llm.generate(batch, params)]


def perplexity(llm: LLM, wins: list[list[int]], reference: LLM | None = None,
               batch: int = 4) -> PerplexityScore:
    """Perplexity of `llm` on the windows; with a reference, how far its distributions move."""
    nll = ref_nll = 0.0
    count = agree = 0
    sq_dp = 0.0
    klds: list[torch.Tensor] = []
    bar = tqdm(total=len(wins), desc="perplexity", unit="window")
    for start in range(0, len(wins), batch):
        chunk = wins[start:start + batch]
        bar.update(len(chunk))
        mine = log_probs(llm, chunk, from_cache=True)
        theirs = (log_probs(reference, chunk, from_cache=True) if reference is not None
                  else [None] * len(chunk))
        for window, lp, ref in zip(chunk, mine, theirs):
            targets = torch.tensor(window[1:], device=lp.device)
            token_lp = lp.gather(1, targets[:, None]).squeeze(1).double()
            nll -= token_lp.sum().item()
            count += len(targets)
            if ref is None:
                continue
            ref = ref.to(lp.device)
            ref_token_lp = ref.gather(1, targets[:, None]).squeeze(1).double()
            ref_nll -= ref_token_lp.sum().item()
            # KL(ref || variant) per position, in fp64 for small differences
            klds.append((ref.exp().double() * (ref.double() - lp.double())).sum(-1).cpu())
            agree += (ref.argmax(-1) == lp.argmax(-1)).sum().item()
            sq_dp += ((token_lp.exp() - ref_token_lp.exp()) ** 2).sum().item()
    bar.close()
    score = PerplexityScore(len(wins), count, math.exp(nll / count))
    if reference is not None:
        kld = torch.cat(klds).clamp_min(0.0)
        score.ref_ppl = math.exp(ref_nll / count)
        score.ppl_change_pct = 100 * (score.ppl / score.ref_ppl - 1)
        score.kld_mean = kld.mean().item()
        score.kld_p99 = kld.sort().values[int(0.99 * (kld.numel() - 1))].item()
        score.kld_max = kld.max().item()
        score.top1_agree_pct = 100 * agree / count
        score.rms_dp_pct = 100 * math.sqrt(sq_dp / count)
    return score
