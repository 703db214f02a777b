"""Generation agreement: greedy answers to chat prompts against a reference configuration.

Scores that average over positions (multiple choice, KL divergence) can hide what a user sees
first: a greedy answer that leaves the reference's in its first tokens and never comes back.
This measures that directly: the same chat prompts answered greedily by both configurations,
how many answers are identical, and where the others first differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frugal.eval.data import Item, load_task
from frugal.llm import LLM
from frugal.request import SamplingParams

TASKS = ("piqa", "openbookqa", "siqa", "commonsenseqa")  # where the questions come from
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


def questions(num_prompts: int) -> list[str]:
    """num_prompts questions, taken in turn from each task's items (lm-eval's prompt wrappers
    removed, so each reads as a user's question)."""
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
    lines = ["| prompts | tokens each | identical answers | mean first divergence (token) |",
             "|---|---|---|---|",
             f"| {a.num_prompts} | {max_tokens} | {a.num_identical} | "
             f"{a.mean_first_divergence:.1f} |"]
    for e in a.examples:
        lines += ["", f"first differing at token {e['first_divergence']}: {e['prompt']!r}",
                  f"  this:      {e['answer'][:160]!r}", f"  reference: {e['reference'][:160]!r}"]
    return lines
