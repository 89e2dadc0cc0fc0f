"""Greedy generations of two computations of the same logits, compared token by token.

Two paths that compute the same logits in a different order agree to within some tolerance
``tol`` per logit. Greedy decoding then picks the same token at every step, except at a step
where the reference's best two logits lie within ``2 * tol`` of each other (a near tie, which
rounding may break either way); after such a step the two generations condition on different
tokens and may differ anywhere. So a test asserts: the tokens are equal up to the first step
where they part, that step is a near tie of the reference, and the logits agree up to and
including that step. A path that reads the wrong token moves logits by far more than ``tol``
and parts the generations at steps whose best two logits are apart, which the check rejects
(``tests/test_greedy.py`` shows it).
"""

from __future__ import annotations

import math

import torch

from rqlib.study.eval import windows

#: A near tie for two fp32 computations of the same logits on the tiny random models, which
#: differ by rounding only: at most 1.5e-7 measured (prefill through an exact cache, and the same
#: fed one token at a time), so 1e-4 leaves a margin of over 300.
ROUNDING_TIE = 1e-4


def parting_steps(tokens: torch.Tensor, expected: torch.Tensor) -> list[int]:
    """Per row of two (batch, steps) token tensors, the first step where they differ (``steps``
    when they never do)."""
    if tokens.shape != expected.shape:
        raise ValueError(f"token shapes differ: {tuple(tokens.shape)} and {tuple(expected.shape)}")
    steps = tokens.shape[1]
    return [int(row.nonzero()[0]) if row.any() else steps for row in (tokens != expected).unbind(0)]


def assert_same_greedy_tokens(
    tokens: torch.Tensor, expected: torch.Tensor, expected_logits, near_tie: float
) -> list[int]:
    """``tokens`` equal ``expected`` (both (batch, steps), the generated tokens only), or each
    row equals up to a step where the reference's best two logits were within ``near_tie``.

    ``expected_logits`` are the reference's logits at each generated step: a (batch, steps,
    vocab) tensor, or ``generate``'s tuple of (batch, vocab) tensors. Returns, per row, the
    number of steps whose logits the two paths share (through the parting step included), for
    the caller to compare the logits over.
    """
    if isinstance(expected_logits, (tuple, list)):
        expected_logits = torch.stack(tuple(expected_logits), 1)
    shared = []
    for row, step in enumerate(parting_steps(tokens, expected)):
        if step < tokens.shape[1]:
            best_two = expected_logits[row, step].float().topk(2).values
            gap = (best_two[0] - best_two[1]).item()
            assert gap <= near_tie, (
                f"row {row}: the generations part at step {step}, where the reference's best "
                f"two logits are {gap:.3g} apart (a near tie is at most {near_tie:.3g})"
            )
        shared.append(min(step + 1, tokens.shape[1]))
    return shared


def top1_near_ties(
    model, token_ids: torch.Tensor, window: int, stride: int | None, near_tie: float
) -> torch.Tensor:
    """For every token that ``evaluate(model, token_ids, window=window, stride=stride)`` scores,
    in its order: whether the full-precision model's best two logits there are within
    ``near_tie``, where a second computation of the same logits may pick the other one."""
    ties = []
    with torch.no_grad():
        for begin, end, first in windows(len(token_ids), window, stride):
            logits = model(token_ids[None, begin:end]).logits[
                0, first - begin - 1 : end - begin - 1
            ]
            best_two = logits.float().topk(2, dim=-1).values
            ties.append(best_two[:, 0] - best_two[:, 1] <= near_tie)
    return torch.cat(ties)


def assert_top1_agrees_but_at_ties(result, near_ties: torch.Tensor) -> None:
    """An evaluation ``result`` picks the full-precision model's top token at every scored token
    but at near ties (``near_ties``, from :func:`top1_near_ties`)."""
    disagree = result.per_token("top1") == 0
    assert disagree.shape == near_ties.shape, (disagree.shape, near_ties.shape)
    apart = (disagree & ~near_ties).nonzero().flatten().tolist()
    assert not apart, f"{result.label}: another top token at scored tokens {apart}, not near ties"


def assert_same_greedy_generation(
    tokens: torch.Tensor,
    expected: torch.Tensor,
    logits: torch.Tensor,
    expected_logits: torch.Tensor,
    tol: float,
) -> float:
    """Two greedy generations (generated tokens (batch, steps), logits (batch, steps, vocab))
    of paths whose logits agree within ``tol``: the same tokens up to a near tie of width
    ``2 * tol`` (:func:`assert_same_greedy_tokens`), and logits within ``tol`` up to and
    including each row's parting step. Returns the largest logit difference over those steps."""
    shared = assert_same_greedy_tokens(tokens, expected, expected_logits, near_tie=2 * tol)
    difference = max(
        (logits[row, :steps] - expected_logits[row, :steps]).abs().max().item()
        for row, steps in enumerate(shared)
    )
    assert math.isfinite(difference) and difference <= tol, (
        f"logits {difference:.3g} apart where the generations agree (tolerance {tol:.3g})"
    )
    return difference
