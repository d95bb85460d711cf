"""The floor's row-parallel projections at rollout TP > 1: what vLLM's CPU engine computes, from its source.

``RowParallelLinear`` (o_proj, down_proj) on rank r multiplies its contiguous K slice and stores a bf16
partial (the bias on rank 0 only); the tp group's all-reduce is ``torch.ops._C.shm_allreduce``
(vllm/distributed/device_communicators/cpu_communicator.py), whose ``all_reduce_sum_impl``
(csrc/cpu/shm.cpp) widens the local partial to ``FP32Vec16``, adds each other rank's in fp32 and converts
the sum back with ``BF16Vec16(FP32Vec16)`` once: round to nearest with AVX512-BF16, the low 16 bits dropped
without (csrc/cpu/cpu_types_x86.hpp). The AVX2 build has no shm op: gloo's all_reduce adds in fp32 and rounds to
nearest (:func:`rlalign_verl.catalog.profiles_tp.vllm_cpu_allreduce_store`). The engine op needs every rank's process, so the floor writes those
source facts here (never read from :mod:`rlalign_verl.catalog.profiles`), as an op Inductor cannot see into, as the
engine's all-reduce is opaque to its compiled graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_OPS: dict[str, Callable] = {}


def shm_all_reduce() -> Callable:
    """``rlalign::cpu_shm_all_reduce(parts, truncate)``: ``sum(parts)`` in fp32 from ``parts[0]`` on, stored once."""
    if "reduce" in _OPS:
        return _OPS["reduce"]

    @torch.library.custom_op("rlalign::cpu_shm_all_reduce", mutates_args=())
    def reduce(parts: list[torch.Tensor], truncate: bool) -> torch.Tensor:
        acc = parts[0].float()  # FP32Vec16 local_data_fp32(local_data)
        for p in parts[1:]:
            acc = acc + p.float()  # local_data_fp32 + remote_data_fp32, rank by rank
        if truncate:  # BF16Vec16(FP32Vec16) in the AVX512 build without BF16: the low 16 bits dropped
            return (acc.view(torch.int32) & -65536).view(torch.float32).to(parts[0].dtype)
        # AVX512-BF16: _mm512_cvtneps_pbh; AVX2 (no shm op): gloo's c10::BFloat16 add: round to nearest even
        return acc.to(parts[0].dtype)

    @reduce.register_fake
    def _(parts, truncate):
        return torch.empty_like(parts[0])

    _OPS["reduce"] = reduce
    return reduce


class RowParallel:
    """``linear(x, weight, bias)`` as ``tp`` vLLM CPU ranks compute it (``tp == 1``: the plain GEMM).

    Built outside the compiled graph: the op and this host's bf16 store are settled once, here.
    """

    def __init__(self, tp: int) -> None:
        from rlalign_verl.catalog.profiles_tp import vllm_cpu_allreduce_store

        self.tp = tp
        self.reduce = shm_all_reduce() if tp > 1 else None
        self.truncate = tp > 1 and vllm_cpu_allreduce_store() == "truncate"

    def __call__(
        self, linear: Callable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.reduce is None:
            return linear(x, weight, bias)
        return self.reduce(self.parts(linear, x, weight, bias), self.truncate)

    def parts(
        self, linear: Callable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """The ranks' bf16 partial products (rank order), before the all-reduce: rank ``r`` multiplies its K slice
        (the bias on rank 0)."""
        k = weight.shape[1] // self.tp
        return [
            linear(x[..., r * k : (r + 1) * k].contiguous(), weight[:, r * k : (r + 1) * k].contiguous(),
                   bias if r == 0 else None)
            for r in range(self.tp)
        ]  # fmt: skip

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings as ``VocabParallelEmbedding`` forms them: each rank looks up the ids of its
        vocab shard (0 elsewhere) and the all-reduce sums them (exact: one nonzero per element). What matters
        for the floor is the opaque op: the compiled graph's residual stream starts from one buffer, not a
        gather of two (:func:`rlalign_verl.align.regions.inductor_norm.stores_sum`)."""
        if self.reduce is None:
            return embedding(ids)
        vocab = embedding.weight.shape[0]
        shard = -(-vocab // self.tp)
        parts = []
        for r in range(self.tp):
            own = (ids >= r * shard) & (ids < (r + 1) * shard)
            parts.append(
                embedding(ids) * own[:, None].to(embedding.weight.dtype)
            )  # masked to 0 off the shard
        return self.reduce(parts, self.truncate)
