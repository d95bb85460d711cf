"""Users see ``[B, T, H]`` hidden states from an aligned model, as from unpatched HF.

``output_hidden_states=True`` and forward hooks on decoder layers get the rounded residual sum ``R(s)``
(for the ``hf`` profile: HF's own tensors, bit for bit); the packed residual stream the engine profile
needs rides along behind it and leaves the logits unchanged. Replacing a layer's output in a hook, or
reentrant checkpointing, would drop that stream: the next layer raises instead of losing precision.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from rlalign_verl.errors import AlignmentError
from rlalign_verl.patch import apply_alignment
from rlalign_verl.profiles import PROFILES
from rlalign_verl.regions.residual_stream import STREAM_ATTR, unpack

BF = torch.bfloat16
H, LAYERS = 64, 3
CONFIGS = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def build(kind: str) -> torch.nn.Module:
    cfg = CONFIGS[kind](
        hidden_size=H, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=128, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=BF)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.normal_(1.0, 0.2)
    return model.eval()


def _layer_outputs(model) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(lambda m, a, o: seen.append(o)) for layer in model.model.layers]
    with torch.no_grad():
        model(IDS)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("profile", list(PROFILES))
def test_hidden_states_and_hooks_see_b_t_h(kind: str, profile: str) -> None:
    model = build(kind)
    with torch.no_grad():
        plain = model(IDS, output_hidden_states=True)
    apply_alignment(model, regions="all", engine=profile)
    with torch.no_grad():
        base = model(IDS).logits
        out = model(IDS, output_hidden_states=True)
    assert torch.equal(out.logits, base)  # asking for hidden states changes nothing
    assert len(out.hidden_states) == LAYERS + 1
    assert all(t.shape == (2, 9, H) and t.dtype == BF for t in out.hidden_states)
    hooked = _layer_outputs(model)
    assert [t.shape for t in hooked] == [(2, 9, H)] * LAYERS
    for t in hooked[:-1]:  # each visible output is R(s) of the sum its stream carries
        s, r = unpack(t, H)
        s = s.float() if r is None else s.float() + r.float()
        assert torch.equal(t, s.to(BF))
    if profile == "hf":  # HF's own hidden states, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(plain.hidden_states, out.hidden_states, strict=True))
        assert torch.equal(plain.logits, out.logits)


@pytest.mark.parametrize("profile, carried", [("vllm", 3), ("sglang", 2), ("vllm-eager", None)])
def test_stream_rides_behind_the_visible_output(profile: str, carried: int | None) -> None:
    model = build("qwen2")
    apply_alignment(model, regions="all", engine=profile)
    first = _layer_outputs(model)[0]
    stream = getattr(first, STREAM_ATTR, None)
    assert (None if stream is None else stream.shape[-1] // H) == carried


def test_hook_replacing_the_output_raises_where_the_stream_matters() -> None:
    model = build("qwen2")
    apply_alignment(model, regions="all", engine="vllm")
    handle = model.model.layers[0].register_forward_hook(lambda m, a, o: o.clone())
    with pytest.raises(AlignmentError, match="decoder layer 1 would lose .*use_reentrant"):
        with torch.no_grad():
            model(IDS)
    handle.remove()
    apply_alignment(model, regions="all", engine="vllm-eager")  # carries only R(s): a replaced output is fine
    handle = model.model.layers[0].register_forward_hook(lambda m, a, o: o.clone())
    with torch.no_grad():
        model(IDS)
    handle.remove()


def test_gradient_checkpointing_reentrant_raises_non_reentrant_is_exact() -> None:
    model = build("qwen2").train()
    apply_alignment(model, regions="all", engine="vllm")
    model.model.embed_tokens.weight.requires_grad_(True)

    def grads(**ckpt) -> list[torch.Tensor]:
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
        model.zero_grad()
        model(IDS).logits.float().logsumexp(-1).sum().backward()
        model.gradient_checkpointing_disable()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads()
    assert all(torch.equal(a, b) for a, b in zip(ref, grads(use_reentrant=False), strict=True))
    with pytest.raises(AlignmentError, match="use_reentrant"):
        grads(use_reentrant=True)
