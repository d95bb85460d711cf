"""Carry what the engine's next norm reads between decoder layers: ``[..., H]`` out, the rest as an argument.

HF's model loop passes a single ``hidden_states`` tensor from layer to layer; engines pass a
``(hidden, residual)`` pair and add it inside the next norm (``s = h + r`` in fp32). What the next norm
needs depends on the profile (:func:`carry_for`):

- ``ROUNDED_SUM``: ``R(h + r)`` only — variance, normalisation and the stored residual all come from the
  rounded sum (HF, vLLM's eager CUDA kernels);
- ``PAIR``: the fp32 sum ``h + r`` of a bf16 pair (vLLM CPU eager, SGLang), stored back as a bf16 residual;
- ``FP32_SUM``: the fp32 sum itself — the residual stream crosses the layer boundary in fp32 (compiled vLLM).

Every aligned layer returns ``R(s)`` ``[..., H]`` in the activation dtype, what HF's own layer returns
(``output_hidden_states`` and forward hooks see it). Where the next norm needs more (``PAIR``,
``FP32_SUM``) the layer also puts the remainder ``s - R(s)`` (exact; see :func:`hand_on`) into a
:class:`ResidualCarry`, a per-forward object the aligned base model passes to every decoder layer as the
keyword argument :data:`CARRY_KWARG`. FSDP2's ``cast_forward_inputs`` casts only tensors it sees in the
arguments; an opaque object is passed through untouched, so an fp32 remainder stays fp32 and no limbs
are needed. :func:`join` rebuilds ``s = R(s) + rest`` exactly; its backward hands ``R(g)`` to the visible
tensor (so FSDP2's per-layer backward hooks on it fire as for HF) and, for ``FP32_SUM``, the exact rest
``g - R(g)`` to the remainder, which :func:`hand_on`'s backward adds back: the fp32 gradient of an fp32
sum crosses the boundary exactly.
"""

from __future__ import annotations

from enum import Enum

import torch

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.catalog.profiles import EngineProfile, Residual, Source

CARRY_KWARG = "rlalign_residual_carry"
"""Keyword argument through which the aligned base model hands its :class:`ResidualCarry` to the layers."""


class Carry(str, Enum):
    ROUNDED_SUM = "rounded_sum"
    PAIR = "pair"
    FP32_SUM = "fp32_sum"


def carry_for(profile: EngineProfile) -> Carry:
    """What crosses a layer boundary for ``profile``'s residual add + RMSNorm."""
    if profile.residual is not Residual.EVERY_ADD:
        return Carry.FP32_SUM
    if profile.norm.variance is Source.ROUNDED_SUM and profile.norm.normalize is Source.ROUNDED_SUM:
        return Carry.ROUNDED_SUM
    return Carry.PAIR


class ResidualCarry:
    """One forward's remainders ``s - R(s)``, keyed by the decoder layer that produced them.

    A plain object (not a tensor, dataclass or container), so FSDP2 and pytree pass it through as is.
    Entries are popped when read, except under gradient checkpointing, where the layer's recompute in
    backward reads its input remainder again; the carry then lives as long as the autograd graph that
    references it (through the checkpoint's saved keyword arguments) and no longer.
    """

    __slots__ = ("_rest", "grad_enabled", "kept", "__weakref__")

    def __init__(self) -> None:
        self._rest: dict[int, torch.Tensor] = {}
        self.grad_enabled = torch.is_grad_enabled()
        self.kept = False

    def __len__(self) -> int:
        return len(self._rest)

    def put(self, layer_idx: int, rest: torch.Tensor) -> None:
        """Store layer ``layer_idx``'s remainder; a checkpoint recompute's identical value keeps the first."""
        self._rest.setdefault(layer_idx, rest)

    def rest_before(self, layer_idx: int, *, keep: bool) -> torch.Tensor | None:
        """The remainder of layer ``layer_idx - 1`` (``None`` for the first layer); ``keep`` leaves it stored."""
        if layer_idx == 0:
            return None
        if layer_idx - 1 not in self._rest:
            raise AlignmentError(
                f"decoder layer {layer_idx} found no residual stream from layer {layer_idx - 1} (layers run out of "
                f"order, or recomputed by a checkpoint wrapper other than HF's); use "
                f"model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': False}})"
            )
        self.kept |= keep
        return self._rest[layer_idx - 1] if keep else self._rest.pop(layer_idx - 1)

    def check_grad(self, layer_idx: int) -> None:
        """Refuse reentrant checkpointing: it runs the layers without autograd and recomputes them from their
        positional arguments only (the layer sees grad mode off inside a forward that started with it on)."""
        if self.grad_enabled and not torch.is_grad_enabled():
            raise AlignmentError(
                f"decoder layer {layer_idx} runs without autograd inside a training forward (reentrant gradient "
                f"checkpointing), which cannot recompute it with the residual stream's remainder; use "
                f"gradient_checkpointing_kwargs={{'use_reentrant': False}}"
            )

    def take_last(self) -> torch.Tensor | None:
        """Pop the last layer's remainder (read by the final norm); ``None`` when there is none."""
        return self._rest.pop(max(self._rest)) if self._rest else None

    def clear(self) -> None:
        self._rest.clear()


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, dtype, rest_dtype):  # type: ignore[override]
        visible = s.to(dtype)
        rest = (s - visible.float()).to(rest_dtype)  # exact: see hand_on
        if rest_dtype != torch.float32:
            ctx.mark_non_differentiable(rest)
        return visible, rest

    @staticmethod
    def backward(ctx, g_visible, g_rest):  # type: ignore[override]
        g = g_visible.float()
        return (g if g_rest is None else g + g_rest), None, None  # straight-through: both parts are the sum


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, visible, rest):  # type: ignore[override]
        ctx.dtype = visible.dtype
        return visible.float() + rest.float()  # == s exactly

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g_visible = g.to(ctx.dtype)  # what HF's bf16 hidden state would receive
        # an fp32 remainder takes the exact rest, so the two add back to g; a bf16 one (PAIR) takes none
        return g_visible, (g - g_visible.float() if ctx.needs_input_grad[1] else None)


def join(visible: torch.Tensor, rest: torch.Tensor | None) -> torch.Tensor:
    """The sum the next norm reads: ``visible`` itself, or the fp32 ``visible + rest`` (exact)."""
    return visible if rest is None else _Join.apply(visible, rest)


def hand_on(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    carry: Carry,
    box: ResidualCarry | None,
    layer_idx: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The layer output ``R(hidden + residual)``; for ``PAIR``/``FP32_SUM`` the remainder goes to ``box``.

    ``dtype``: the activation dtype (default ``hidden.dtype``); an fp32 ``hidden`` in a bf16 model (an MLP
    output the engine never rounds, ``MoeRounding.block_sum="fp32"``) keeps an fp32 remainder.

    ``FP32_SUM``: the remainder ``s - R(s)`` of an fp32 sum is exact in fp32 and carries the fp32 gradient.
    ``PAIR``: ``hidden`` and ``residual`` are both bf16, and the rounding error of a sum of two bf16 values
    is itself a bf16 value (the TwoSum property; where fp32 rounds ``h + r`` first, the exponent gap is
    above 16 and ``s - R(s)`` is ``r`` on fp32's grid, 8 bits), so the remainder is stored in bf16, as the
    engine's bf16 pair costs. Its gradient goes through the visible tensor only: the engine pair's
    ``h`` and ``r`` each receive the bf16 gradient ``R(g)`` there too.
    """
    dtype = dtype or hidden.dtype
    s = hidden.float() + residual.float()  # the fp32 sum the engine's next norm forms
    if carry is Carry.ROUNDED_SUM or dtype == torch.float32:
        return s.to(dtype)
    if box is None:
        raise AlignmentError(
            f"decoder layer {layer_idx} was called without the residual carry the aligned base model passes "
            f"({CARRY_KWARG}); call the model (or model.model), not its decoder layers one by one"
        )
    rest_dtype = dtype if carry is Carry.PAIR and hidden.dtype == dtype else torch.float32
    visible, rest = _Split.apply(s, dtype, rest_dtype)
    box.put(layer_idx, rest)
    return visible
