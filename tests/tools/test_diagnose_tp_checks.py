"""``diagnose --tp N`` (and a dump's ``tensor_parallel_size``) is refused before the engine starts where the
diagnosis cannot mirror the engine's split: a width N does not divide (heads, MLP, routed or shared expert), a size
the profile does not describe. MoE models pass, with (Qwen2-MoE) or without (Qwen3-MoE) a shared expert."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.catalog.profiles import get_profile
from rlalign_verl.tools.diagnose.pipeline import check_tp

ROUTED = Qwen3MoeConfig(num_attention_heads=4, intermediate_size=96, moe_intermediate_size=64, num_experts=4)


def test_moe_models_pass_and_tp_1_is_never_refused() -> None:
    check_tp(ROUTED, Path("m"), 2, get_profile("vllm-cpu"))
    check_tp(Qwen2MoeConfig(num_attention_heads=4), Path("m"), 2, get_profile("vllm-cpu"))
    check_tp(Qwen2MoeConfig(), Path("m"), 1, get_profile("vllm-cpu"))


@pytest.mark.parametrize(
    ("config", "tp", "words"),
    [
        (Qwen2MoeConfig(num_attention_heads=4, shared_expert_intermediate_size=5630), 4,
         "shared_expert_intermediate_size=5630 (m) is not divisible by it"),
        (Qwen3MoeConfig(num_attention_heads=4, intermediate_size=96, moe_intermediate_size=66), 4,
         "moe_intermediate_size=66 (m) is not divisible by it"),
        (ROUTED, 4, "profile vllm-cpu models tensor parallel 2"),
    ],
)  # fmt: skip
def test_what_diagnose_cannot_mirror_is_refused_in_one_line(config, tp, words) -> None:
    with pytest.raises(AlignmentError) as info:
        check_tp(config, Path("m"), tp, get_profile("vllm-cpu"))
    assert words in str(info.value) and "\n" not in str(info.value)
