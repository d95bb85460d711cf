"""The one bootstrap (rlalign_verl/measure/intervals.py): the same draws as one plain resampling call, chunked or
not, and the percentile interval torch.quantile gives."""

from __future__ import annotations

import pytest
import torch

from rlalign_verl.measure import intervals
from rlalign_verl.measure.intervals import percentile_interval, ratio_interval, resampled_sums


def _plain(columns: torch.Tensor, seed: int, n_boot: int) -> torch.Tensor:
    """Resampling as written out by hand: one index draw of [n_boot, U], each row summed."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, columns.shape[1], (n_boot, columns.shape[1]), generator=gen)
    return torch.stack([c[idx].sum(1) for c in columns.double()])


@pytest.mark.parametrize("chunk", [1 << 22, 7, 1])  # one block; a few rows per block; one row per block
def test_chunked_draws_are_the_plain_draws(monkeypatch, chunk):
    monkeypatch.setattr(intervals, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(1)
    columns = torch.rand(3, 5, generator=g, dtype=torch.float64)
    assert torch.equal(resampled_sums(columns, seed=4, n_boot=50), _plain(columns, 4, 50))


def test_the_interval_is_torch_quantiles():
    draws = torch.randn(1001, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = torch.quantile(draws, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    assert percentile_interval(draws) == pytest.approx(want, rel=1e-15, abs=1e-15)


def test_ratio_interval_brackets_the_ratio_and_narrows_with_more_units():
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(5, 20, (8,), generator=g).double()
    sums = counts * (0.1 + 0.01 * torch.randn(8, generator=g, dtype=torch.float64))
    lo, hi = ratio_interval(sums, counts, seed=0, n_boot=2000)
    assert lo < float(sums.sum() / counts.sum()) < hi
    lo4, hi4 = ratio_interval(sums.repeat(4), counts.repeat(4), seed=0, n_boot=2000)
    assert hi4 - lo4 < hi - lo  # four times the units: a narrower interval (about half)
