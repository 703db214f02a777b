"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Callable

import torch

from frugal.request import Request, TokenLogprob
from frugal.worker.step_inputs import upload


class Sampler:
    """Picks one token per row of logits.

    Random rows use the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p;
    a seeded request draws its noise from its own generator, so its tokens depend only on its seed
    and logits, never on what else is in the batch.
    """

    def __init__(self, device: str, seed: int, eos_token_ids: list[int],
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """argmax: [n, vocab] -> [n] int64 for the greedy rows (default: torch's)."""
        self.device = device
        self.argmax = argmax or (lambda logits: logits.argmax(dim=-1))
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits: [n, vocab] (any float dtype; greedy rows take their argmax as is, the rest
        is computed in fp32), row i for requests[i] -> [n] int64 token ids."""
        params = [r.params for r in requests]
        early = [i for i, r in enumerate(requests)  # (tokens sampled ahead count as output)
                 if len(r.output_token_ids) + r.num_pending < r.params.min_tokens]
        if early:  # min_tokens: nothing that would end the output may be picked yet
            logits = logits.clone()
            vocab = logits.shape[1]
            flat = [i * vocab + t for i in early
                    for t in params[i].stop_token_ids
                    + ([] if params[i].ignore_eos else self.eos_token_ids)]
            # (index_fill_, not logits[i, ids] = ...: that assignment waits for the device)
            logits.view(-1).index_fill_(0, upload(flat, torch.int64, logits.device),
                                        float("-inf"))
        greedy = self.argmax(logits)
        if all(p.greedy for p in params):
            return greedy
        n, vocab = logits.shape
        logits = logits.float()
        # (host lists reach the device through `upload`: torch.tensor(..., device=) would wait
        # for the device, and a decode step launched ahead would no longer overlap the host)
        temperature = upload([1.0 if p.greedy else p.temperature for p in params],
                             torch.float32, logits.device)
        logits = logits / temperature[:, None]
        top_k = [vocab if p.top_k in (-1, 0) else min(p.top_k, vocab) for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, upload(top_k, torch.int64, logits.device),
                                       upload(top_p, torch.float32, logits.device))
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            draws = torch.empty(len(shared), vocab, device=logits.device)
            noise[upload(shared, torch.int64, logits.device)] = draws.exponential_(
                generator=self.generator)
        for i, r in enumerate(requests):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        sampled = self.argmax(probs / noise)
        is_greedy = upload([int(p.greedy) for p in params], torch.int32, logits.device) != 0
        return torch.where(is_greedy, greedy, sampled)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   num_top: list[int]) -> list[TokenLogprob]:
    """Raw log-probabilities of token_ids under logits, with each row's num_top best tokens.

    logits: [n, vocab] (upcast to fp32 here); token_ids: [n] int64; num_top: [n] counts.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprob(t, c, list(zip(top_ids[i][:num_top[i]], top_values[i][:num_top[i]])))
            for i, (t, c) in enumerate(zip(token_ids.tolist(), chosen))]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what falls outside each row's top-k and its top-p nucleus.

    logits: [n, vocab]; top_k: [n] int64 in [1, vocab] (vocab = off); top_p: [n] in (0, 1].
    The most likely token always survives.
    """
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    kth_largest = ascending.gather(1, (vocab - top_k).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1.0 - top_p).unsqueeze(1)
    outside[:, -1] = False
    ascending = ascending.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)
