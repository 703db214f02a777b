"""Generation agreement (frugal eval --generate): questions from the eval data, and the count of
identical answers and first divergences."""

from frugal.eval import generation


def test_agreement_counts_identical_answers_and_first_divergences():
    ours = [[1, 2, 3], [1, 2, 9, 9], [5], [1, 2]]
    ref = [[1, 2, 3], [1, 2, 3, 4], [6], [1, 2, 3]]
    a = generation.agreement(ours, ref, ["p0", "p1", "p2", "p3"], lambda ids: str(ids),
                             num_examples=2)
    assert a.num_prompts == 4 and a.num_identical == 1
    assert a.first_divergence == [3, 2, 0, 2] and a.mean_first_divergence == 7 / 4
    assert [e["prompt"] for e in a.examples] == ["p1", "p2"]
    assert a.examples[0] == {"prompt": "p1", "first_divergence": 2, "answer": "[1, 2, 9, 9]",
                             "reference": "[1, 2, 3, 4]"}


def test_questions_come_in_turn_from_each_task_without_prompt_wrappers():
    qs = generation.questions(8)
    assert len(qs) == 8 and len(set(qs)) == 8
    assert not any(q.startswith(("Question:", "Q:")) or q.endswith(("Answer:", "A:"))
                   for q in qs)


def test_answers_of_the_same_configuration_agree(llm):
    prompts = generation.questions(3)
    a = generation.answers(llm, prompts, 8)
    agree = generation.agreement(a, generation.answers(llm, prompts, 8), prompts,
                                 llm.get_tokenizer().decode)
    assert agree.num_identical == 3 and all(len(x) >= 1 for x in a)
