"""The MoE part of the tiny-model recipe (see :mod:`.tiny`): configs and the checkpoint key layout."""

from __future__ import annotations


def moe_config(spec, common: dict):
    """``(config, architecture)`` of a tiny Qwen3-MoE / Qwen2-MoE from its spec and the dense fields."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    moe = dict(
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        use_sliding_window=False,
    )
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, **moe, head_dim=spec.head_dim, attention_bias=False
        ), "Qwen3MoeForCausalLM"
    shared = dict(shared_expert_intermediate_size=spec.shared_expert_intermediate)
    return Qwen2MoeConfig(**common, **moe, **shared), "Qwen2MoeForCausalLM"


def per_expert_keys(state: dict) -> dict:
    """HF's fused 3-D expert tensors as the per-expert keys of the released Qwen MoE checkpoints.

    ``...experts.gate_up_proj [E, 2I, H]`` -> ``...experts.{e}.gate_proj.weight`` / ``up_proj.weight``,
    ``...experts.down_proj [E, H, I]`` -> ``...experts.{e}.down_proj.weight``: the layout vLLM's loader
    expects; transformers fuses them back on load.
    """
    out = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("mlp.experts") and leaf == "gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif prefix.endswith("mlp.experts") and leaf == "down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out
