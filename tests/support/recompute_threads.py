"""A recompute that must match a single-threaded other side (an OpenRLHF Ray worker, an engine rank) runs
single-threaded too: the engine tests' recompute as ``rlalign-verl diagnose`` does for tiny models and as each
engine rank ran (one core per rank). Where the bf16 GEMM's result depends on the thread count
(oneDNN's bf16 GEMM on AVX512 without AVX512-BF16, measured this session as that class: TP=2 eager 998/1024 tokens
exact with 2 threads, 1024/1024 with 1; compiled TP=1 16/128 tokens off with 2 threads, 0 with 1), a bit-exact
claim compares like with like only so; on the other classes the thread count changes nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
