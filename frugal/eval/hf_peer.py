"""HF transformers as a reference scorer (`frugal eval --scorer hf`): the same token ids through
transformers' own model of the same checkpoint, to check frugal's numbers against."""

from __future__ import annotations

import torch

from frugal.eval.multiple_choice import Scorer
from frugal.loader import load_transformers_model


def hf_scorer(model: str | None, device: str, dtype: torch.dtype, batch: int = 16) -> Scorer:
    hf = load_transformers_model(model, device, dtype)

    @torch.inference_mode()
    def score(sequences: list[list[int]], context_lens: list[int]) -> list[float]:
        lls = []
        for start in range(0, len(sequences), batch):
            seqs = sequences[start:start + batch]
            width = max(map(len, seqs))
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):  # right padding: positions stay those of the unpadded run
                ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
            logits = hf(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            logprobs = logits.float().log_softmax(-1)
            for i, (s, ctx) in enumerate(zip(seqs, context_lens[start:start + batch])):
                targets = torch.tensor(s[ctx:], device=device)
                lls.append(logprobs[i, ctx - 1:len(s) - 1].gather(1, targets[:, None]).sum().item())
        return lls

    return score
