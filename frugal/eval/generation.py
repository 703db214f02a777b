"""Generation agreement: greedy answers to chat prompts against a reference configuration.

Scores that average over positions (multiple choice, KL divergence) can hide what a user sees
first: a greedy answer that leaves the reference's in its first tokens and never comes back.
This measures that directly: the same chat prompts answered greedily by both configurations,
how many answers are identical, and where the others first differ; and, teacher-forced on the
reference's answers, how far the next-token distributions over them are apart (KL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from frugal.eval.data import Item, load_task
from frugal.eval.perplexity import log_probs
from frugal.llm import LLM
from frugal.request import SamplingParams

TASKS = ("piqa", "openbookqa", "siqa", "commonsenseqa")  # where the questions come from
CHAT = [  # what a user asks first, before the questions of the tasks
    "What is the capital of France?",
    "Explain in a few paragraphs how a refrigerator keeps food cold.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "What is 17 multiplied by 23? Show the steps.",
    "List ten animals that live in the ocean and one fact about each.",
    "Summarize the causes of the French Revolution for a high-school student.",
    "Translate to French: The weather is nice today and we are going to the market.",
    "Give three tips for writing clear technical documentation.",
]
_WRAPPERS = (("Question: ", "\nAnswer:"), ("Q: ", "\nA:"), ("", "\nAnswer:"))


@dataclass
class Agreement:
    """num_identical of num_prompts answers equal token for token; first_divergence[i]: the
    index of the first token where answer i differs (its length, the shorter one's if one is a
    prefix of the other, when they agree throughout)."""

    num_prompts: int
    num_identical: int
    mean_first_divergence: float
    first_divergence: list[int]
    examples: list[dict] = field(default_factory=list)  # the first differing answers, both
    kl_mean: float | None = None  # teacher-forced on the reference's answers (see divergence)
    top1_agree_pct: float | None = None


def prompts(num_prompts: int) -> list[str]:
    """The built-in chat prompts (CHAT), then questions of the tasks: num_prompts in all."""
    return CHAT[:num_prompts] + questions(max(num_prompts - len(CHAT), 0))


def questions(num_prompts: int) -> list[str]:
    """num_prompts questions, taken in turn from each task's items (lm-eval's prompt wrappers
    removed, so each reads as a user's question)."""
    if num_prompts == 0:
        return []
    per_task = -(-num_prompts // len(TASKS))
    items = [load_task(t, per_task).items for t in TASKS]
    out = []
    for i in range(per_task):
        out += [_question(task_items[i]) for task_items in items if i < len(task_items)]
    return out[:num_prompts]


def _question(item: Item) -> str:
    text = item.context
    for prefix, suffix in _WRAPPERS:
        if text.startswith(prefix) and text.endswith(suffix):
            return text[len(prefix):len(text) - len(suffix)].strip()
    return text.strip()


def answers(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy answers (token ids) to each prompt as a one-turn chat."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def divergence(llm: LLM, reference: LLM, prompts: list[str],
               reference_answers: list[list[int]], agree: Agreement, batch: int = 8) -> None:
    """Fill agree's KL and top-1 agreement: both configurations read each chat prompt followed by
    the reference's answer; KL(reference || llm) of the next-token distribution (fp64) and
    top-1 agreement at the positions that predict the answer's tokens. Each position reads the
    ones before it through the KV cache, as the decode step that generated it did (a quantized
    cache's effect; prompt attention would read the answer's K/V as computed)."""
    tokenizer = llm.get_tokenizer()
    klds, agreeing = [], 0
    for start in range(0, len(prompts), batch):
        chats = [tokenizer.encode_chat([{"role": "user", "content": p}], True)
                 for p in prompts[start:start + batch]]
        answers_ = reference_answers[start:start + batch]
        sequences = [c + list(a) for c, a in zip(chats, answers_)]
        for chat, mine, ref in zip(chats, log_probs(llm, sequences, from_cache=True),
                                   log_probs(reference, sequences, from_cache=True)):
            mine, ref = mine[len(chat) - 1:].double(), ref[len(chat) - 1:].to(mine.device).double()
            klds.append((ref.exp() * (ref - mine)).sum(-1).clamp_min(0.0).cpu())
            agreeing += (ref.argmax(-1) == mine.argmax(-1)).sum().item()
    kld = torch.cat(klds)
    agree.kl_mean = kld.mean().item() if kld.numel() else 0.0
    agree.top1_agree_pct = 100 * agreeing / max(kld.numel(), 1)


def agreement(ours: list[list[int]], reference: list[list[int]], prompts: list[str],
              decode, num_examples: int = 5) -> Agreement:
    """Compare answers position by position; decode turns token ids into text."""
    firsts, identical, examples = [], 0, []
    for prompt, a, b in zip(prompts, ours, reference):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        firsts.append(first)
        if a == b:
            identical += 1
        elif len(examples) < num_examples:
            examples.append({"prompt": prompt, "first_divergence": first,
                             "answer": decode(a), "reference": decode(b)})
    return Agreement(len(prompts), identical, sum(firsts) / max(len(firsts), 1), firsts,
                     examples)


def format_agreement(a: Agreement, max_tokens: int) -> list[str]:
    kl = ("—" if a.kl_mean is None
          else f"{a.kl_mean:.5f} | {a.top1_agree_pct:.2f}")
    lines = ["| prompts | tokens each | identical answers | mean first divergence (token) | "
             "mean KL (teacher-forced) | top-1 agree % |", "|---|---|---|---|---|---|",
             f"| {a.num_prompts} | {max_tokens} | {a.num_identical} | "
             f"{a.mean_first_divergence:.1f} | {kl} |"]
    for e in a.examples:
        lines += ["", f"first differing at token {e['first_divergence']}: {e['prompt']!r}",
                  f"  this:      {e['answer'][:160]!r}", f"  reference: {e['reference'][:160]!r}"]
    return lines
