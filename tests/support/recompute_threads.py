"""A recompute that must match a single-threaded other side (an OpenRLHF Ray worker, an engine rank) runs
single-threaded too: the engine tests' recompute as ``rlalign-verl diagnose`` does for tiny models and as each
engine rank ran (one core per rank). Where the bf16 GEMM's result depends on the thread count
(oneDNN's bf16 GEMM on AVX512 without AVX512-BF16, measured this session as that class: TP=2 eager 998/1024 tokens
exact with 2 threads, 1024/1024 with 1; compiled TP=1 16/128 tokens off with 2 threads, 0 with 1), a bit-exact
claim compares like with like only so; on the other classes the thread count changes nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def engine_gaps(hf: Any, run: Any, regions: tuple[str, ...], **options: Any) -> torch.Tensor:
    """Per-token |Δlogp| of ``hf`` aligned with ``regions`` (none: unaligned) to the engine rollouts ``run`` (the
    conftest's ``engine_rollouts``: its header's profile and TP size), recomputed single-threaded."""
    from rlalign_verl.align.patch import apply_alignment, remove_alignment
    from rlalign_verl.tools.diagnose.pipeline import recompute

    if regions:
        apply_alignment(hf, regions=regions, engine=run.header.profile, rollout_tp=run.tp, **options)
    try:
        with single_thread():
            lps = recompute(
                lambda ids: hf(input_ids=ids[None]).logits[0], run.rollouts, f"{regions} {options}"
            )
    finally:
        remove_alignment(hf)
    engine = torch.tensor([x for r in run.rollouts for x in r.response_logprobs])
    return (torch.cat(lps) - engine).abs()
