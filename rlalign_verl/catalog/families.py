"""Model families the patcher supports, as data: one row per HF architecture.

The generic patcher (:mod:`rlalign_verl.align.patch`) reads only these rows; adding a family whose
decoder layer has the usual ``input_layernorm -> self_attn -> post_attention_layernorm -> mlp``
shape is a new row, not new code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from rlalign_verl.base.errors import UnsupportedModelError


@dataclass(frozen=True)
class ModelFamily:
    """Where a transformers architecture keeps the modules the regions touch."""

    model_type: str
    modeling_module: str
    base_model: str
    decoder_layer: str
    attention: str
    mlp: str
    rmsnorm: str
    qk_norm: bool
    """Attention has per-head ``q_norm``/``k_norm`` (Qwen3) before RoPE."""
    experts: str | None = None
    """MoE families: the class holding all routed experts' weights as 3-D tensors (``None``: dense)."""
    router: str | None = None
    """MoE families: the top-k router (its ``weight`` is the gate linear)."""
    moe_block: str | None = None
    """MoE families: the sparse block (router + experts, and in Qwen2-MoE the gated shared expert)."""
    shared_expert: bool = False
    """The sparse block adds a gated shared expert (Qwen2-MoE): ``sigmoid(gate) * shared + routed``, which vLLM's
    compiled CPU graph at rollout TP 1 forms inside the next norm's kernel."""

    def module(self) -> ModuleType:
        return importlib.import_module(self.modeling_module)

    def cls(self, attr: str) -> type:
        """The class named by field ``attr`` (e.g. ``"decoder_layer"``)."""
        return getattr(self.module(), getattr(self, attr))


FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in (
        ModelFamily(
            model_type="qwen2",
            modeling_module="transformers.models.qwen2.modeling_qwen2",
            base_model="Qwen2Model",
            decoder_layer="Qwen2DecoderLayer",
            attention="Qwen2Attention",
            mlp="Qwen2MLP",
            rmsnorm="Qwen2RMSNorm",
            qk_norm=False,
        ),
        ModelFamily(
            model_type="qwen3",
            modeling_module="transformers.models.qwen3.modeling_qwen3",
            base_model="Qwen3Model",
            decoder_layer="Qwen3DecoderLayer",
            attention="Qwen3Attention",
            mlp="Qwen3MLP",
            rmsnorm="Qwen3RMSNorm",
            qk_norm=True,
        ),
        ModelFamily(
            model_type="llama",
            modeling_module="transformers.models.llama.modeling_llama",
            base_model="LlamaModel",
            decoder_layer="LlamaDecoderLayer",
            attention="LlamaAttention",
            mlp="LlamaMLP",
            rmsnorm="LlamaRMSNorm",
            qk_norm=False,
        ),
        # MoE: ``mlp`` is the dense MLP class (dense layers and Qwen2-MoE's shared expert)
        ModelFamily(
            model_type="qwen3_moe",
            modeling_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
            base_model="Qwen3MoeModel",
            decoder_layer="Qwen3MoeDecoderLayer",
            attention="Qwen3MoeAttention",
            mlp="Qwen3MoeMLP",
            rmsnorm="Qwen3MoeRMSNorm",
            qk_norm=True,
            experts="Qwen3MoeExperts",
            router="Qwen3MoeTopKRouter",
            moe_block="Qwen3MoeSparseMoeBlock",
        ),
        ModelFamily(
            model_type="qwen2_moe",
            modeling_module="transformers.models.qwen2_moe.modeling_qwen2_moe",
            base_model="Qwen2MoeModel",
            decoder_layer="Qwen2MoeDecoderLayer",
            attention="Qwen2MoeAttention",
            mlp="Qwen2MoeMLP",
            rmsnorm="Qwen2MoeRMSNorm",
            qk_norm=False,
            experts="Qwen2MoeExperts",
            router="Qwen2MoeTopKRouter",
            moe_block="Qwen2MoeSparseMoeBlock",
            shared_expert=True,
        ),
    )
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def get_family(model_type: str) -> ModelFamily:
    """The family row for ``model_type`` (``config.model_type``); a clear error otherwise."""
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported by rlalign-verl (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); run without alignment (verl: alignment.regions=[]; OpenRLHF: "
            f"--alignment.regions none) or add a row for it to rlalign_verl/catalog/families.py"
        )
    return FAMILIES[model_type]
