"""Multiple choice by log-likelihood, scored through the engine's serving path.

Each choice's score is the sum of the prompt log-probabilities of its continuation tokens, computed
by the engine on context + continuation (the same paged KV cache, KV dtype, weights and kernels a
request would use). acc picks the highest sum, acc_norm the highest sum per character (as
lm-evaluation-harness does). Two runs compare item by item: a paired difference, its 95 %
confidence interval and the number of answers that flipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from frugal.eval.data import Item
from frugal.llm import LLM
from frugal.request import SamplingParams
from frugal.tokenizer import Tokenizer

Scorer = Callable[[list[list[int]], list[int]], list[float]]  # (sequences, context lengths) -> lls


@dataclass
class ItemScore:
    task: str
    index: int
    gold: int
    lls: list[float]  # log-likelihood of each choice
    lengths: list[int]  # characters of each choice (for acc_norm)

    @property
    def pred(self) -> int:
        return max(range(len(self.lls)), key=lambda i: self.lls[i])

    @property
    def pred_norm(self) -> int:
        return max(range(len(self.lls)), key=lambda i: self.lls[i] / max(self.lengths[i], 1))


@dataclass
class TaskScore:
    task: str
    num_items: int
    acc: float
    acc_stderr: float
    acc_norm: float
    acc_norm_stderr: float


@dataclass
class PairedScore:
    """variant - reference on the same items, in accuracy points (x100)."""

    task: str
    num_items: int
    diff: float
    ci_low: float
    ci_high: float
    gained: int  # right under the variant only
    lost: int  # right under the reference only


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int],
                                                                               list[int]]:
    """lm-eval's split: trailing spaces of the context move to the continuation, the whole text is
    encoded once and the continuation is what follows the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return whole[:len(context_ids)], whole[len(context_ids):]


def engine_scorer(llm: LLM) -> Scorer:
    """Log-likelihood of seq[ctx:] given seq[:ctx], from the engine's prompt log-probabilities
    of the continuation only (so the context's full pages may come from the prefix cache: the
    choices of an item share them). The continuation reads its own tokens through the KV cache
    too (SamplingParams.prompt_from_cache), as decode steps do, whether the context was a hit."""

    def score(sequences: list[list[int]], context_lens: list[int]) -> list[float]:
        params = [SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                                 prompt_logprobs_start=ctx, prompt_from_cache=True)
                  for ctx in context_lens]
        outputs = llm.generate(sequences, params)
        return [sum(e.logprob for e in out.prompt_logprobs[ctx:])
                for out, ctx in zip(outputs, context_lens)]

    return score


def score_items(items: list[Item], tokenizer: Tokenizer, scorer: Scorer, batch: int = 64,
                desc: str = "score") -> list[ItemScore]:
    """Every choice of every item, `batch` items per call to the scorer."""
    results = []
    bar = tqdm(total=len(items), desc=desc, unit="item")
    for start in range(0, len(items), batch):
        chunk = items[start:start + batch]
        sequences, context_lens = [], []
        for item in chunk:
            for choice in item.choices:
                ctx, cont = encode_pair(tokenizer, item.context, choice)
                if not ctx or not cont:
                    raise ValueError(f"{item.task} item {item.index}: empty context or choice")
                sequences.append(ctx + cont)
                context_lens.append(len(ctx))
        lls = scorer(sequences, context_lens)
        k = 0
        for item in chunk:
            n = len(item.choices)
            results.append(ItemScore(item.task, item.index, item.gold, lls[k:k + n],
                                     [len(t) for t in item.choice_texts]))
            k += n
        bar.update(len(chunk))
    bar.close()
    return results


def _mean_stderr(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def task_scores(scores: list[ItemScore]) -> list[TaskScore]:
    out = []
    for task in dict.fromkeys(s.task for s in scores):
        mine = [s for s in scores if s.task == task]
        acc = _mean_stderr([float(s.pred == s.gold) for s in mine])
        norm = _mean_stderr([float(s.pred_norm == s.gold) for s in mine])
        out.append(TaskScore(task, len(mine), 100 * acc[0], 100 * acc[1], 100 * norm[0],
                             100 * norm[1]))
    return out


def paired_scores(variant: list[ItemScore], reference: list[ItemScore]) -> list[PairedScore]:
    """Per task (and over all tasks given), matched by (task, index)."""
    ref = {(s.task, s.index): s for s in reference}
    missing = [(s.task, s.index) for s in variant if (s.task, s.index) not in ref]
    if missing:
        raise ValueError(f"reference: {len(missing)} items have no reference score, "
                         f"e.g. {missing[0]} (were both runs given the same --limit?)")
    out = []
    tasks = list(dict.fromkeys(s.task for s in variant))
    groups = [(t, [s for s in variant if s.task == t]) for t in tasks]
    if len(tasks) > 1:
        groups.append(("all", variant))
    for task, mine in groups:
        diffs = [float(s.pred == s.gold) - float(ref[(s.task, s.index)].pred == s.gold)
                 for s in mine]
        mean, stderr = _mean_stderr(diffs)
        stderr = 0.0 if math.isnan(stderr) else stderr
        out.append(PairedScore(task, len(mine), 100 * mean, 100 * (mean - 1.96 * stderr),
                               100 * (mean + 1.96 * stderr), diffs.count(1.0),
                               diffs.count(-1.0)))
    return out


def save_items(path: str, scores: list[ItemScore], config: str) -> None:
    Path(path).write_text(json.dumps({"config": config, "items": [asdict(s) for s in scores]}))


def load_items(path: str) -> list[ItemScore]:
    try:
        data = json.loads(Path(path).read_text())
        return [ItemScore(**s) for s in data["items"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"reference-items: cannot read {path} ({e})") from e
