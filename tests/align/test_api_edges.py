"""Python API edges, round 4: a module holding two models, and non-models given to remove/get_alignment."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlalign_verl import apply_alignment, get_alignment, remove_alignment
from rlalign_verl.base.errors import UnsupportedModelError


def _qwen2(theta: float) -> nn.Module:
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=32, rope_theta=theta)  # fmt: skip
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


class _Pair(nn.Module):
    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.a, self.b, self.config = a, b, a.config


def test_a_module_holding_two_models_is_refused_and_each_model_aligns_on_its_own():
    """One patch of the container took the first model's rotary table for both (sglang's fp32 table: a wrong
    rotation in the second, said nowhere)."""
    a, b = _qwen2(1e4), _qwen2(1e6)
    pair = _Pair(a, b)
    with pytest.raises(UnsupportedModelError, match="holds 2 Qwen2Model models; align each on its own"):
        apply_alignment(pair, regions=["rope"], engine="sglang")
    assert get_alignment(a) is None and get_alignment(b) is None
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    ref = _qwen2(1e6)
    ref.load_state_dict(b.state_dict())
    apply_alignment(ref, regions=["rope"], engine="sglang")
    apply_alignment(a, regions=["rope"], engine="sglang")
    apply_alignment(b, regions=["rope"], engine="sglang")
    assert torch.equal(b(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("bad", ["path/to/model", 5, {"w": torch.zeros(1)}])
def test_remove_and_get_alignment_refuse_a_non_model_in_one_line(bad):
    with pytest.raises(UnsupportedModelError, match="remove_alignment needs a torch.nn.Module"):
        remove_alignment(bad)
    with pytest.raises(UnsupportedModelError, match="get_alignment needs a torch.nn.Module"):
        get_alignment(bad)
    with pytest.raises(UnsupportedModelError, match="get_alignment needs the model"):
        get_alignment(None)
