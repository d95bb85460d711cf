"""The vLLM CPU build's own attention op, called on a training batch (the ``attention`` region's ``engine-op``).

``torch.ops._C.cpu_attention_with_kv_cache`` on the batch laid out as the engine's paged KV cache (block size
``ENGINE_BLOCK_SIZE``, the CPU platform's default). The region's math and backward live in
:mod:`rlalign_verl.align.regions.attention`; this module is the adapter that imports vLLM.
"""

from __future__ import annotations

import functools

import torch

from rlalign_verl.align.regions.attention import segment_lengths

ENGINE_BLOCK_SIZE = 128
"""vLLM CPU's default KV-cache block size (``vllm/platforms/cpu.py`` ``check_and_update_config``)."""


@functools.cache
def _engine_isa(dtype: torch.dtype, head_dim: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, ENGINE_BLOCK_SIZE, head_dim)
    if isa == "amx":
        torch.cpu._init_amx()  # the kernel's AMX tiles need the OS permission oneDNN would otherwise request
    return isa


def engine_op_available() -> tuple[bool, str]:
    """Whether vLLM's CPU attention op can be called here; the reason if not."""
    try:
        # vllm._custom_ops loads the kernel library built for this CPU's ISA (vllm/platforms/cpu.py
        # import_kernels: _C needs AVX512-BF16, else _C_AVX512 or _C_AVX2); `import vllm._C` would crash without it
        import vllm._custom_ops  # noqa: F401

        torch.ops._C.cpu_attention_with_kv_cache  # noqa: B018
    except Exception as e:  # noqa: BLE001 - any import/registration failure means "not here"
        return False, f"{type(e).__name__}: {e}".splitlines()[0]
    return True, ""


def engine_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, scale: float
) -> torch.Tensor:
    """``cpu_attention_with_kv_cache`` on packed ``q [N, Hq, D]``, ``k/v [N, Hkv, D]`` (causal per sequence).

    The KV of each sequence is written into a paged cache of ``ENGINE_BLOCK_SIZE`` blocks with the
    engine's own ``cpu_attn_reshape_and_cache``, as the engine's prefill does.
    """
    from vllm import envs

    n, hq, d = q.shape
    hkv, bs = k.shape[1], ENGINE_BLOCK_SIZE
    lens = segment_lengths(ids).to(torch.int32)
    nseq = lens.shape[0]
    nblk = (lens + bs - 1) // bs
    max_blk = int(nblk.max())
    first = torch.zeros(nseq, dtype=torch.int64)
    first[1:] = torch.cumsum(nblk, 0)[:-1]
    block_table = (first[:, None] + torch.arange(max_blk)[None, :]).to(torch.int32)
    qsl = torch.zeros(nseq + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    tok = torch.arange(n) - qsl[:-1].long().repeat_interleave(lens.long())
    slots = block_table.long()[ids, tok // bs] * bs + tok % bs
    cache = torch.zeros(int(nblk.sum()), hkv, 2 * bs, d, dtype=k.dtype)
    k_cache, v_cache = cache.chunk(2, dim=2)
    isa = _engine_isa(q.dtype, d)
    torch.ops._C.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa, 1.0, 1.0, "auto")
    meta = torch.ops._C.get_scheduler_metadata(
        nseq, hq, hkv, d, lens, q.dtype, qsl, True, -1, isa, envs.VLLM_CPU_ATTN_SPLIT_KV, None, "auto"
    )
    out = torch.empty_like(q)
    torch.ops._C.cpu_attention_with_kv_cache(
        q,
        k_cache,
        v_cache,
        out,
        qsl,
        lens,
        scale,
        True,
        None,
        -1,
        block_table,
        0.0,
        meta,
        None,
        None,
        1.0,
        1.0,
        "auto",
    )
    return out
