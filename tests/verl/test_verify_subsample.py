"""Verify's subsample keeps at least ``verify.max_seqs`` sequences (>= 8, what a verdict needs): rounded to the
data-parallel size (verl) or the actor count (OpenRLHF) upward, never below the cap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")

from rlalign_verl.verl.verify_run import _subsample  # noqa: E402

pytestmark = pytest.mark.verl


@pytest.mark.parametrize(
    ("n", "cap", "dp", "k"),
    [
        (24, 8, 3, 9),
        (64, 8, 6, 12),
        (40, 8, 5, 10),
        (100, 64, 8, 64),
        (6, 8, 4, 6),
        (9, 8, 4, 8),
        (8, 8, 3, 8),
    ],
)
def test_the_verl_subsample_is_rounded_up_to_the_data_parallel_size(n, cap, dp, k):
    assert _subsample(n, cap, dp) == k
    assert k == n or (k >= cap and k % dp == 0)


@pytest.mark.parametrize(
    ("sizes", "cap", "actors", "kept"),
    [((2,) * 12, 8, 3, 6), ((2,) * 12, 8, 1, 4), ((3,) * 5, 8, 2, 4), ((2, 2), 8, 3, 2), ((16,), 8, 1, 1)],
)
def test_the_openrlhf_subsample_holds_at_least_the_cap(sizes, cap, actors, kept):
    from rlalign_verl.openrlhf.verify import _subsample as openrlhf_subsample

    experiences = [SimpleNamespace(sequences=torch.zeros(n, 4)) for n in sizes]
    chosen = openrlhf_subsample(experiences, cap, actors)
    assert len(chosen) == kept
    total = sum(e.sequences.shape[0] for e in chosen)
    assert total >= min(cap, sum(sizes)) and (len(chosen) % actors == 0 or len(chosen) == len(sizes))
