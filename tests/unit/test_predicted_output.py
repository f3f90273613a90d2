"""A prediction followed through an output that repeats it, departs from it and comes back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.predicted_output import PredictionAligner


def test_an_output_that_repeats_the_prediction_is_drafted_ahead() -> None:
    aligner = PredictionAligner([1, 2, 3, 4, 5, 6])
    assert aligner.drafts([], [], 3) == [1, 2, 3]
    assert aligner.drafts([1, 2], [], 3) == [3, 4, 5]
    assert aligner.drafts([1, 2], [3], 8) == [4, 5, 6]  # after this step's pending tokens
    assert aligner.drafts([1, 2, 3, 4, 5, 6], [], 3) == []  # the prediction is used up


def test_after_an_edit_the_prediction_is_found_again() -> None:
    # {"name": "Bo", "age": 7} edited to {"name": "Al", "age": 7}: tokens 10 11 12 13 14 15 16 17 with 13 -> 90 91
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    aligner = PredictionAligner(prediction)
    assert aligner.drafts([10, 11, 12], [], 4) == [13, 14, 15, 16]
    assert aligner.drafts([10, 11, 12, 90], [], 4) == []  # departed: no draft until the output meets it again
    assert aligner.drafts([10, 11, 12, 90, 91, 14, 15], [], 4) == [16, 17]  # "14 15" occurs: back in step


def test_a_token_left_out_replaced_or_put_before_is_a_local_edit() -> None:
    prediction = [1, 2, 3, 4, 5, 6]
    left_out = PredictionAligner(prediction)
    assert left_out.drafts([1, 2, 4], [], 2) == [5, 6]  # 3 left out: in step again at once
    replaced = PredictionAligner(prediction)
    assert replaced.drafts([1, 2, 9], [], 2) == []
    assert replaced.drafts([1, 2, 9, 4], [], 2) == [5, 6]  # 9 for 3
    put_before = PredictionAligner(prediction)
    assert put_before.drafts([1, 2, 9, 9, 3], [], 2) == [4, 5]
    assert [aligner.num_rejected for aligner in (left_out, replaced, put_before)] == [1 + 2, 1 + 2, 0 + 3]


def test_an_edit_in_a_prediction_that_repeats_itself_stays_local() -> None:
    """The output's tokens before and at the edit occur earlier in the prediction: the local edit is taken, not a jump
    back to that earlier copy."""
    sentence = [20, 21, 22, 23, 24]
    prediction = [*sentence, 30, 20, 21, 23, 23, 24, 31]  # the second copy's 22 edited to 23
    output = [*sentence, 30, *sentence, 31]
    aligner = PredictionAligner(prediction)
    aligner.follow(output)
    assert (aligner.num_accepted, aligner.num_rejected) == (len(prediction) - 1, 1)


def test_realignment_prefers_the_place_after_the_last_one() -> None:
    prediction = [1, 2, 7, 1, 2, 8, 1, 2, 9]  # "1 2" three times
    aligner = PredictionAligner(prediction)
    assert aligner.drafts([1, 2, 7, 1], [], 2) == [2, 8]
    assert aligner.drafts([1, 2, 7, 1, 2, 5, 1, 2], [], 1) == [9]  # the occurrence after the departure, not the first


@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), max_size=30), st.integers(0, 30))
def test_drafts_are_always_a_run_of_the_prediction(prediction: list[int], output: list[int], cut: int) -> None:
    """Whatever the output does, a draft is a contiguous run of the prediction, and following the output in two
    steps finds what following it in one does."""
    aligner = PredictionAligner(prediction)
    aligner.drafts(output[:cut], [], 4)
    drafts = aligner.drafts(output, [], 4)
    assert drafts == PredictionAligner(prediction).drafts(output, [], 4)
    runs = [prediction[start : start + len(drafts)] for start in range(len(prediction) - len(drafts) + 1)]
    assert not drafts or drafts in runs


def test_the_counts_say_which_prediction_tokens_the_output_repeated() -> None:
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    exact = PredictionAligner(prediction)
    exact.follow([*prediction, 2])  # the answer, then a stop token the prediction does not hold
    assert (exact.num_accepted, exact.num_rejected) == (8, 0)
    edited = PredictionAligner(prediction)
    edited.follow([10, 11, 12, 90, 91, 14, 15, 16, 17])  # 13 replaced: the rest is found again
    assert (edited.num_accepted, edited.num_rejected) == (7, 1)
    other = PredictionAligner(prediction)
    other.follow([50, 51, 52])
    assert (other.num_accepted, other.num_rejected) == (0, 8)


def test_drafts_after_pending_tokens_do_not_count_them() -> None:
    """Tokens drafted this step may yet be rejected: they steer the drafts after them, not the counts."""
    aligner = PredictionAligner([1, 2, 3, 4, 5])
    assert aligner.drafts([1], [2, 3], 2) == [4, 5]
    assert aligner.num_accepted == 1


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40), st.integers(0, 40))
def test_counts_partition_the_prediction_and_do_not_depend_on_the_steps(
    prediction: list[int], output: list[int], cut: int
) -> None:
    stepwise = PredictionAligner(prediction)
    stepwise.follow(output[:cut])
    stepwise.drafts(output, output[:3], 4)
    at_once = PredictionAligner(prediction)
    at_once.follow(output)
    assert (stepwise.num_accepted, stepwise.num_rejected) == (at_once.num_accepted, at_once.num_rejected)
    assert stepwise.num_accepted + stepwise.num_rejected == len(prediction)
    assert stepwise.num_accepted <= len(output)  # each output token is matched with one prediction token at most
