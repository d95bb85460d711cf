"""What a forward keeps for backward, by module (the memory tests' counter)."""

from __future__ import annotations

from collections import defaultdict

import torch


def saved_by_module(
    model: torch.nn.Module, ids: torch.Tensor
) -> dict[str, list[tuple[tuple[int, ...], torch.dtype, int]]]:
    """Distinct non-parameter storages saved for backward by one forward, keyed by the module that saved
    each first: ``name -> [(shape, dtype, storage bytes), ...]`` (a view counts its whole storage: what it keeps
    alive)."""
    stack = ["<model>"]
    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: stack.append(n)))
        handles.append(mod.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1]))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, tuple[int, ...], torch.dtype, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (stack[-1], tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    del out
    by_module: dict[str, list] = defaultdict(list)
    for name, shape, dtype, nbytes in seen.values():
        by_module[name].append((shape, dtype, nbytes))
    return by_module
