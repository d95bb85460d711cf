"""Bytes autograd keeps for backward: ``saved_tensors_hooks`` around a forward, unique storages summed.

Every tensor autograd saves (``save_for_backward`` of built-in ops, custom ``autograd.Function`` s and
compiled graphs alike) passes the pack hook; tensors that share a storage (views, the same tensor saved
twice) count once, at the storage's full size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def _key(t: torch.Tensor) -> tuple[int, str]:
    return t.untyped_storage().data_ptr(), str(t.device)


def saved_bytes(forward: Callable[[], object], inputs: Iterable[torch.Tensor] = ()) -> tuple[int, int]:
    """``(saved, saved beyond inputs)``: bytes of the unique storages saved for backward while ``forward`` runs,
    and the part not shared with ``inputs`` (what the region keeps alive on top of its arguments).

    ``forward``'s outputs are dropped when it returns, which frees the graph and what it saved.
    """
    seen: dict[tuple[int, str], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    held = {_key(x) for x in inputs}
    return sum(seen.values()), sum(n for k, n in seen.items() if k not in held)
