"""The Triton kernels are opt-in: the default SwiGLU/RoPE forward is the PyTorch fp32 path everywhere.

A CUDA tensor is faked with an object whose ``is_cuda`` is True (the selection reads only that), and a
spy on :func:`rlalign_verl.align.kernels.available` records what every patched forward asked for.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlalign_verl.align import kernels
from rlalign_verl.align.patch import apply_alignment, get_alignment

HAS_TRITON = importlib.util.find_spec("triton") is not None
FAKE_CUDA = SimpleNamespace(is_cuda=True)


def test_default_is_torch() -> None:
    assert kernels.available(FAKE_CUDA) is False  # a CUDA tensor, nothing asked: PyTorch path
    assert kernels.available(torch.zeros(1), requested=True) is False  # CPU tensors never take Triton


def test_requested_on_cuda_takes_triton_when_installed() -> None:
    assert kernels.available(FAKE_CUDA, requested=True) is HAS_TRITON


def _spy_requests(monkeypatch: pytest.MonkeyPatch, kernels_arg: str | None) -> tuple[str, set[bool]]:
    seen: set[bool] = set()
    real = kernels.available

    def spy(t, requested=False):
        seen.add(bool(requested))
        return real(t, requested)

    monkeypatch.setattr(kernels, "available", spy)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    apply_alignment(model, regions="all", engine="vllm", kernels=kernels_arg)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 8)))
    return get_alignment(model).kernels, seen


def test_patched_model_asks_for_torch_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    choice, seen = _spy_requests(monkeypatch, None)
    assert choice == "torch"
    assert seen == {False}  # every SwiGLU/RoPE forward ran the PyTorch path


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_patched_model_asks_for_triton_when_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    choice, seen = _spy_requests(monkeypatch, "triton")
    assert choice == "triton" and seen == {True}
