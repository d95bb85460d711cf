"""TP region: the row-parallel projections (``o_proj``, ``down_proj``) as the rollout engine computes them
under tensor parallelism of size N, parameterised by :class:`~rlalign_verl.profiles_tp.TpReduction`.

The engine's ``RowParallelLinear`` splits the input dimension K into N contiguous slices (rank r holds the
heads / intermediate columns ``r*K/N .. (r+1)*K/N``); each rank's GEMM stores its partial product in bf16,
and the all-reduce sums the partials. The trainer's single GEMM over all of K rounds once instead: that one
rounding location is what separates a TP>1 rollout from the trainer. Backward is autograd's through the
slices (each partial receives the bf16 gradient of the sum, as the engine's reduce would pass it back).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..profiles_tp import TpReduction
from ._precision import store_as


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int, reduction: TpReduction
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` computed as ``tp`` ranks compute it and ``reduction`` sums it."""
    if tp == 1:
        return F.linear(x, weight, bias)
    k = weight.shape[1] // tp
    # rank r's GEMM over its K slice stores a bf16 partial; the bias is added on rank 0 only, inside its GEMM
    parts = [
        F.linear(x[..., r * k : (r + 1) * k], weight[:, r * k : (r + 1) * k], bias if r == 0 else None)
        for r in range(tp)
    ]
    if reduction.accumulate == "fp32":
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()  # the all-reduce accumulates in fp32, ranks 0..N-1 (rank 0's order)
        return store_as(acc, reduction.store, x.dtype)  # and stores the sum once
    out = parts[0]
    for p in parts[1:]:
        out = store_as(out.float() + p.float(), reduction.store, x.dtype)  # bf16 per hop: a rounding per add
    return out


def row_parallel_forward(tp: int, reduction: TpReduction) -> Callable:
    """The forward bound on a row-parallel ``nn.Linear`` (:func:`rlalign_verl.binding.bind`)."""

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x, self.weight, self.bias, tp, reduction)

    return forward
