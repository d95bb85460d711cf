"""The aligned forwards bound onto model instances by :mod:`rlalign_verl.align.patch`.

One decoder layer, attention, MLP and final-norm forward serve every family; the :class:`AlignmentState`
(regions + engine profile) closed over by each decides where it rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rlalign_verl.align.binding import cache_kwarg, checkpointed, original_forward, pop_cache
from rlalign_verl.align.regions.attention import attention_interface
from rlalign_verl.align.regions.residual_stream import (
    CARRY_KWARG,
    Carry,
    ResidualCarry,
    carry_for,
    hand_on,
    join,
)
from rlalign_verl.align.regions.rmsnorm import add_rms_norm, rms_norm
from rlalign_verl.align.regions.rope import apply_rope, rope_table
from rlalign_verl.align.regions.swiglu import swiglu
from rlalign_verl.base.errors import ComputeDtypeError
from rlalign_verl.catalog.families import get_family
from rlalign_verl.catalog.profiles import HF, EngineProfile, Residual
from rlalign_verl.request.regions import shown_settings
from rlalign_verl.request.spec import AlignmentSpec


@dataclass(frozen=True)
class AlignmentState:
    """What is active on a model: the request (:class:`AlignmentSpec`), the profile it resolved to, the family."""

    spec: AlignmentSpec
    profile: EngineProfile
    model_type: str

    @property
    def regions(self) -> tuple[str, ...]:
        return self.spec.regions

    @property
    def compiled(self) -> bool:
        """SwiGLU and RoPE run as Inductor-compiled functions (bit-identical; :mod:`.regions.compiled`)."""
        return self.spec.experimental.compile

    @property
    def kernels(self) -> str:
        """SwiGLU/RoPE forwards on CUDA: ``"torch"`` fp32 ops (default) or the opt-in ``"triton"`` kernels."""
        return self.spec.experimental.kernels

    @property
    def attention_variant(self) -> str:
        """``attention`` region: ``engine-op`` or ``sdpa-fp32`` (:mod:`.regions.attention`)."""
        return self.spec.experimental.attention

    @property
    def head_dtype(self) -> str:
        """``lm_head`` region: the engine's head dtype, ``float32`` or ``model`` (:mod:`.regions.lm_head`)."""
        return self.spec.experimental.head_dtype

    @property
    def compiled_norm(self) -> bool:
        """Norm forwards compiled by Inductor as the engine compiles them (:mod:`.regions.inductor_norm`)."""
        return self.spec.experimental.compiled_norm

    @property
    def unverified(self) -> tuple[str, ...]:
        return self.spec.experimental.unverified

    @property
    def moe_variant(self) -> str:
        """MoE experts + combine: ``emulate`` (PyTorch) or ``engine-op`` (:mod:`.engine_ops.moe_op`)."""
        return self.spec.experimental.moe_variant

    def describe(self) -> str:
        extra = (" compiled" if self.compiled else "") + (" triton" if self.kernels == "triton" else "")
        for dotted in shown_settings(self.regions):  # each region's own setting (the registry's `shows`)
            value = self.spec
            for part in dotted.split("."):
                value = getattr(value, part)
            extra += f" {dotted.rsplit('.', 1)[-1]}={value}"
        extra += " compiled_norm" if self.compiled_norm else ""
        extra += f" unverified={','.join(self.unverified)}" if self.unverified else ""
        extra += f" moe_variant={self.moe_variant}" if self.moe_variant != "emulate" else ""
        return f"regions={list(self.regions)} profile={self.profile.name} model_type={self.model_type}{extra}"

    # the rounding each region uses: the profile's where aligned, HF's own elsewhere
    @property
    def rope(self):
        return self.profile.rope if "rope" in self.regions else HF.rope

    @property
    def swiglu(self):
        return self.profile.swiglu if "swiglu" in self.regions else HF.swiglu

    @property
    def norm(self):
        return self.profile.norm if "rmsnorm" in self.regions else HF.norm


# --- aligned forwards (bound to instances; ``st`` is closed over) ---------------------------------


def region_fns(st: AlignmentState) -> tuple[Callable, Callable]:
    """``(swiglu(g, u), rope(q, k, cos, sin, out_dtype))`` with ``st``'s rounding, eager or compiled."""
    if st.compiled:
        from rlalign_verl.align.regions.compiled import compiled_regions

        fns = compiled_regions(st.profile, exact=True)
        if "rope" in st.regions:  # compiled with the profile's rounding: only where rope is aligned
            return fns.swiglu, fns.apply_rope
        return fns.swiglu, lambda q, k, cos, sin, out_dtype: apply_rope(
            q, k, cos, sin, st.rope, out_dtype=out_dtype
        )

    triton = st.kernels == "triton"

    def swiglu_fn(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up, st.swiglu, triton=triton)

    def rope_fn(q, k, cos, sin, out_dtype):
        return apply_rope(q, k, cos, sin, st.rope, out_dtype=out_dtype, triton=triton)

    return swiglu_fn, rope_fn


def norm_fns(st: AlignmentState) -> tuple[Callable, Callable]:
    """``(rms_norm, add_rms_norm)``: eager, or compiled as the engine compiles them (``st.compiled_norm``).

    ``add_rms_norm`` takes ``index=`` (the norm's position along the residual stream), which picks the
    engine's kernel shape for the compiled norms and is ignored by the eager ones.
    """
    if st.compiled_norm:
        from rlalign_verl.align.regions.inductor_norm import inductor_norms, mlp_output_reads

        tp = st.spec.rollout_tp
        return inductor_norms(st.profile, tp, mlp_output_reads(get_family(st.model_type), tp))

    def add_norm(*args, index: int | None = None, **kwargs):
        return add_rms_norm(*args, **kwargs)

    return rms_norm, add_norm


def require_bf16(t: torch.Tensor, where: str) -> None:
    """Every profile mirrors a bf16 engine: rounding an fp32 (or fp16) computation to bf16 points would change
    it without matching anything, so an aligned region refuses such tensors (the check is one dtype compare)."""
    if t.dtype is not torch.bfloat16:
        raise ComputeDtypeError(
            f"the aligned model computes in {str(t.dtype).removeprefix('torch.')} ({where}), but alignment mirrors "
            "a bf16 engine; run the model in bf16 as the engine does (model.to(torch.bfloat16), FSDP mixed "
            "precision with param_dtype=bf16, or torch.autocast(device_type, dtype=torch.bfloat16)), or turn "
            "alignment off"
        )


def compute_probe(weight: torch.Tensor) -> torch.Tensor:
    """An empty tensor of the dtype a layer with ``weight`` computes in: the autocast dtype where autocast is on
    for its device (fp32 master weights under ``torch.autocast(bf16)``), else the weight's own dtype."""
    device = weight.device.type
    try:
        autocast = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type without autocast (meta)
        autocast = False
    dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
    return weight.new_empty(0, dtype=dtype)


def mlp_hidden(st: AlignmentState) -> Callable:
    """``hidden(mlp, x)``: a SwiGLU MLP's output before ``down_proj``, with the swiglu region's rounding where it is
    aligned and HF's own ``act_fn(gate_proj(x)) * up_proj(x)`` elsewhere."""
    if "swiglu" not in st.regions:
        return lambda m, x: m.act_fn(m.gate_proj(x)) * m.up_proj(x)
    swiglu_fn, _ = region_fns(st)

    def hidden(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate = m.gate_proj(x)
        require_bf16(gate, "the SwiGLU input gate_proj(x)")
        return swiglu_fn(gate, m.up_proj(x))

    return hidden


def mlp_forward(st: AlignmentState) -> Callable:
    hidden = mlp_hidden(st)

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(hidden(self, x))

    return forward


def attention_forward(st: AlignmentState, rotary: nn.Module) -> Callable:
    """The aligned attention of ``st``'s family; ``rotary`` is the base model's rotary embedding (for fp32 tables)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    family = get_family(st.model_type)
    eager_attention = family.module().eager_attention_forward
    norm_on = "rmsnorm" in st.regions
    # Inductor fuses q/k-norm into RoPE on some paths: the normalised q/k is then never rounded.
    fuse_qk_rope = norm_on and "rope" in st.regions and not st.profile.qk_norm_rounded_before_rope
    fp32_table = st.rope.table == "fp32"
    # the hf profile keeps HF's own attention (aligning to it changes nothing)
    on = "attention" in st.regions and st.profile.engine != "hf"
    aligned_attn = None
    if on:
        kernel = None
        if st.attention_variant == "engine-op":
            from rlalign_verl.align.engine_ops.attention_op import (
                engine_attention,  # the vLLM CPU build's own op
            )

            kernel = engine_attention
        aligned_attn = attention_interface(kernel)
    qk_norm, _ = norm_fns(st)
    _, rope_fn = region_fns(st)

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ):
        kv_cache = pop_cache(kwargs, past_key_values)  # transformers >= 5.24 passes it as cache=
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        require_bf16(v, "the attention projections")
        if family.qk_norm:
            if norm_on:
                q = qk_norm(
                    q, self.q_norm.weight, self.q_norm.variance_epsilon, st.norm, keep_fp32=fuse_qk_rope
                )
                k = qk_norm(
                    k, self.k_norm.weight, self.k_norm.variance_epsilon, st.norm, keep_fp32=fuse_qk_rope
                )
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)

        if fp32_table:
            position_ids = kwargs.get("position_ids")
            if position_ids is None:
                raise ValueError("an fp32-table RoPE profile needs position_ids in the attention call")
            cos, sin = rope_table(rotary.inv_freq, position_ids, rotary.attention_scaling)
        else:
            cos, sin = position_embeddings
        q, k = rope_fn(q, k, cos, sin, out_dtype=v.dtype)

        if kv_cache is not None:
            k, v = kv_cache.update(k, v, self.layer_idx)
        attention = aligned_attn or ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention
        )
        if hasattr(self, "sliding_window"):
            kwargs["sliding_window"] = self.sliding_window
        out, weights = attention(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights

    return forward


def layer_forward(st: AlignmentState) -> Callable:
    """vLLM-style layer: returns ``R(s)`` ``[..., H]`` as HF does; the remainder ``s - R(s)`` the next
    norm needs (``carry_for(profile)``) travels in the :class:`ResidualCarry` passed as ``kwargs[CARRY_KWARG]``."""
    mode = st.profile.residual
    carry = carry_for(st.profile)
    # the input norm's residual leaves the compiled piece before attention (AT_ATTENTION) or is
    # stored at every add (EVERY_ADD); only a one-graph model (NEVER) keeps it fp32 throughout.
    round_at_input = mode in (Residual.EVERY_ADD, Residual.AT_ATTENTION)
    round_at_post = mode is Residual.EVERY_ADD
    _, add_norm = norm_fns(st)

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        kv_cache = pop_cache(kwargs, past_key_values)  # transformers >= 5.24 passes it as cache=
        ln_in, ln_post = self.input_layernorm, self.post_attention_layernorm
        require_bf16(compute_probe(ln_in.weight), "the decoder layer's weights, no bf16 autocast")
        box: ResidualCarry | None = kwargs.pop(CARRY_KWARG, None)
        idx = self.self_attn.layer_idx
        rest = None
        if box is not None and carry is not Carry.ROUNDED_SUM and hidden_states.dtype != torch.float32:
            box.check_grad(idx)
            # HF's checkpointing recomputes this layer in backward from the same kwargs: keep the entry
            ckpt = self.training and getattr(self, "gradient_checkpointing", False)
            keep = torch.is_grad_enabled() and ckpt
            rest = box.rest_before(idx, keep=keep)
        at = 2 * idx  # position of the input norm along the residual stream
        x, residual = add_norm(
            join(hidden_states, rest),  # the sum itself: R(s) (+ the remainder), or the embedding
            None,
            ln_in.weight,
            ln_in.variance_epsilon,
            st.norm,
            round_residual=round_at_input,
            out_dtype=hidden_states.dtype,
            index=at,
        )
        a, _ = self.self_attn(
            hidden_states=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **{cache_kwarg(type(self.self_attn)): kv_cache},
            **kwargs,
        )
        x, residual = add_norm(
            a,
            residual,
            ln_post.weight,
            ln_post.variance_epsilon,
            st.norm,
            round_residual=round_at_post,
            index=at + 1,
        )
        return hand_on(self.mlp(x), residual, carry, box, idx, x.dtype)

    return checkpointed(forward)  # transformers >= 5.23 checkpoints in the class forward this replaces


CARRY_ATTR = "_rlalign_residual_carry"
"""Final-norm attribute holding the running forward's :class:`ResidualCarry` (set by the base model)."""


def base_model_forward(st: AlignmentState) -> Callable:
    """The base model's forward with a fresh :class:`ResidualCarry` passed to the decoder layers (HF hands
    its ``**kwargs`` to every layer) and lent to the final norm (which takes no kwargs) for one call."""

    def forward(self: nn.Module, *args, **kwargs):
        box = ResidualCarry()
        norm_dict = self.norm.__dict__
        previous = norm_dict.get(CARRY_ATTR)
        norm_dict[CARRY_ATTR] = box
        try:
            return original_forward(self)(*args, **kwargs, **{CARRY_KWARG: box})
        finally:
            if previous is None:
                norm_dict.pop(CARRY_ATTR, None)
            else:
                norm_dict[CARRY_ATTR] = previous
            if not box.kept:  # no checkpoint recompute will read it: nothing outlives the forward
                box.clear()

    return forward


def final_norm_forward(st: AlignmentState, index: int | None = None) -> Callable:
    """The final norm; ``index``: its position along the residual stream (2 x layers), which picks the engine's
    kernel shape for the compiled norms."""
    _, add_norm = norm_fns(st)

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        box = self.__dict__.get(CARRY_ATTR)
        h = join(hidden_states, box.take_last() if box is not None else None)
        y, _ = add_norm(  # at TP=1 the final norm's even position never stores the sum; at TP>1 it can
            h,
            None,
            self.weight,
            self.variance_epsilon,
            st.norm,
            round_residual=True,
            out_dtype=hidden_states.dtype,
            index=index,
        )
        return y

    return forward
