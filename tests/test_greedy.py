"""The near-tie checks of tests/greedy.py accept rounding at a tie and reject anything else."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from greedy import (
    assert_same_greedy_generation,
    assert_same_greedy_tokens,
    assert_top1_agrees_but_at_ties,
    parting_steps,
)

VOCAB, STEPS, TIE = 50, 6, 1e-3


def logits_with_gap(rng, row_gaps: dict[tuple[int, int], float]) -> torch.Tensor:
    """Random (2, STEPS, VOCAB) logits whose best two are 1 apart, but at the listed (row,
    step) where they are the given gap apart."""
    logits = torch.rand(2, STEPS, VOCAB, generator=rng)  # all in [0, 1)
    logits[..., 0] = 2.0
    logits[..., 1] = 1.0
    for (row, step), gap in row_gaps.items():
        logits[row, step, 1] = 2.0 - gap
    return logits


def test_parting_steps_find_the_first_difference(rng):
    tokens = torch.randint(0, VOCAB, (3, STEPS), generator=rng)
    other = tokens.clone()
    other[1, 4:] += 1
    other[2, 2] += 1
    assert parting_steps(tokens, other) == [STEPS, 4, 2]
    with pytest.raises(ValueError, match="token shapes differ"):
        parting_steps(tokens, other[:, 1:])


def test_a_parting_at_a_near_tie_is_accepted_and_ends_the_shared_steps(rng):
    step = int(torch.randint(0, STEPS, (1,), generator=rng))
    logits = logits_with_gap(rng, {(1, step): TIE / 2})
    expected = logits.argmax(-1)
    tokens = expected.clone()
    tokens[1, step] = 1  # the runner-up of a near tie
    assert assert_same_greedy_tokens(tokens, expected, logits, TIE) == [STEPS, step + 1]
    # the same logits as generate's tuple of steps
    assert assert_same_greedy_tokens(tokens, expected, logits.unbind(1), TIE) == [STEPS, step + 1]


def test_a_parting_where_the_best_two_are_apart_is_rejected(rng):
    step = int(torch.randint(0, STEPS, (1,), generator=rng))
    logits = logits_with_gap(rng, {(1, step): 3 * TIE})  # close, but not a near tie
    expected = logits.argmax(-1)
    tokens = expected.clone()
    tokens[1, step] = 1
    with pytest.raises(AssertionError, match=f"row 1: the generations part at step {step}"):
        assert_same_greedy_tokens(tokens, expected, logits, TIE)


def test_top1_disagreements_are_accepted_at_ties_only(rng):
    n = 40
    ties = torch.zeros(n, dtype=torch.bool)
    at_tie, apart = torch.randperm(n, generator=rng)[:2].tolist()
    ties[at_tie] = True
    top1 = torch.ones(n)
    top1[at_tie] = 0
    result = SimpleNamespace(label="m", per_token=lambda name: top1)
    assert_top1_agrees_but_at_ties(result, ties)
    top1[apart] = 0
    with pytest.raises(AssertionError, match=rf"at scored tokens \[{apart}\], not near ties"):
        assert_top1_agrees_but_at_ties(result, ties)


def test_logits_are_compared_through_the_parting_step_only(rng):
    step = int(torch.randint(0, STEPS - 1, (1,), generator=rng))
    expected_logits = logits_with_gap(rng, {(0, step): TIE / 2})
    expected = expected_logits.argmax(-1)
    tokens = expected.clone()
    tokens[0, step] = 1  # row 0 parts at a near tie; later steps see other tokens
    logits = expected_logits.clone()
    logits[0, step + 1 :] += 1.0  # after the parting: anything goes
    assert assert_same_greedy_generation(tokens, expected, logits, expected_logits, TIE / 2) == 0
    logits[1, step] += TIE  # where both rows still agree: twice the tolerance off
    with pytest.raises(AssertionError, match="logits 0.001 apart where the generations agree"):
        assert_same_greedy_generation(tokens, expected, logits, expected_logits, TIE / 2)
