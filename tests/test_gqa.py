"""Grouped-query attention helpers: query head h reads KV head h // G.

Random inputs come from the ``rng`` fixture; the checks are exact or float64 rounding (1e-12),
so no test here fails by chance (false-failure rate 0).
"""

import pytest
import torch

from rqlib.core.gqa import expand_kv_heads, fold_queries, group_size, unfold_queries


def test_expand_kv_heads_maps_query_head_to_its_group(rng):
    key = torch.randn(2, 3, 5, 4, generator=rng)
    expanded = expand_kv_heads(key, 6)
    for head in range(6):
        assert torch.equal(expanded[:, head], key[:, head // 2])
    with pytest.raises(ValueError, match="multiple"):
        expand_kv_heads(key, 4)


def test_fold_queries_agrees_with_expanded_heads(rng):
    # folding the group into the rows and one matmul per KV head gives what repeating the KV
    # heads does; unfold puts every query head back in its place
    q = torch.randn(2, 6, 5, 4, generator=rng, dtype=torch.float64)
    keys = torch.randn(2, 3, 7, 4, generator=rng, dtype=torch.float64)
    folded = fold_queries(q, 3)
    assert folded.shape == (2, 3, 10, 4)
    scores = unfold_queries(folded @ keys.transpose(-1, -2), 6)
    expected = q @ expand_kv_heads(keys, 6).transpose(-1, -2)
    torch.testing.assert_close(scores, expected, rtol=1e-12, atol=1e-12)  # float64 rounding
    assert torch.equal(unfold_queries(folded, 6), q)


def test_group_size_refuses_a_partial_group():
    assert group_size(8, 2) == 4
    for q_heads, kv_heads in ((7, 2), (4, 0)):
        with pytest.raises(ValueError, match="multiple"):
            group_size(q_heads, kv_heads)
