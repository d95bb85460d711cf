"""Users see ``[B, T, H]`` hidden states from an aligned model, as from unpatched HF.

``output_hidden_states=True`` and forward hooks on decoder layers get ``R(s)``, the rounded sum the
engine's next norm reads (for the ``hf`` profile: HF's own tensors, bit for bit). The fp32 remainder the
``PAIR``/``FP32_SUM`` profiles need travels in a per-forward :class:`ResidualCarry` passed to the layers
as a keyword argument; these tests check that it reaches the next norm, that gradients through it are
exact (checkpointed or not), that generation with a KV cache works and that nothing outlives a forward.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import rlalign_verl.align.forwards as forwards
from rlalign_verl.align.patch import apply_alignment, remove_alignment
from rlalign_verl.align.regions.residual_stream import CARRY_KWARG, Carry, carry_for
from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.catalog.profiles import PROFILES, get_profile

BF = torch.bfloat16
H, LAYERS = 64, 3
CONFIGS = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def build(kind: str = "qwen2") -> torch.nn.Module:
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


def norm_inputs(model, monkeypatch) -> list[torch.Tensor]:
    """Record the sum every aligned input/final norm reads (the first argument of its residual-less call)."""
    seen: list[torch.Tensor] = []
    real = forwards.add_rms_norm

    def spy(h, residual, *args, **kwargs):
        if residual is None:
            seen.append(h.detach().clone())
        return real(h, residual, *args, **kwargs)

    monkeypatch.setattr(forwards, "add_rms_norm", spy)
    return seen


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("profile", list(PROFILES))
def test_hidden_states_and_hooks_see_b_t_h(kind: str, profile: str, monkeypatch) -> None:
    model = build(kind)
    with torch.no_grad():
        plain = model(IDS, output_hidden_states=True)
    apply_alignment(model, regions="all", engine=profile)
    hooked: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, a, o: hooked.append(o))
    sums = norm_inputs(model, monkeypatch)
    with torch.no_grad():
        out = model(IDS, output_hidden_states=True)
        base = model(IDS).logits
    assert torch.equal(out.logits, base)  # asking for hidden states changes nothing
    assert len(out.hidden_states) == LAYERS + 1
    assert all(t.shape == (2, 9, H) and t.dtype == BF for t in out.hidden_states)
    assert [t.shape for t in hooked] == [(2, 9, H)] * (2 * LAYERS)
    # each layer's visible output is R(s) of the sum the next norm reads (the embedding feeds layer 0)
    s = sums[1 : LAYERS + 1]
    assert all(torch.equal(v, t.to(BF)) for v, t in zip(hooked[:LAYERS], s, strict=True))
    fp32_carried = carry_for(get_profile(profile)) is not Carry.ROUNDED_SUM
    assert all(t.dtype == (torch.float32 if fp32_carried else BF) for t in s)
    if fp32_carried:  # the remainder is really used: the sum is not the rounded visible value
        assert any(not torch.equal(t, t.to(BF).float()) for t in s)
    if profile == "hf":  # HF's own hidden states and logits, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(plain.hidden_states, out.hidden_states, strict=True))
        assert torch.equal(plain.logits, out.logits)


def grads(model, **ckpt) -> list[torch.Tensor]:
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
    model.zero_grad()
    try:
        model(IDS).logits.float().logsumexp(-1).sum().backward()
    finally:
        model.gradient_checkpointing_disable()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("profile", ["vllm", "sglang", "vllm-eager"])
def test_checkpointing_non_reentrant_is_exact_reentrant_raises(profile: str) -> None:
    model = build()
    apply_alignment(model, regions="all", engine=profile)
    ref = grads(model)
    assert all(torch.equal(a, b) for a, b in zip(ref, grads(model, use_reentrant=False), strict=True))
    if carry_for(get_profile(profile)) is Carry.ROUNDED_SUM:
        grads(model, use_reentrant=True)  # nothing travels beside the layer output: reentrant is fine
        return
    with pytest.raises(AlignmentError, match=r"reentrant.*use_reentrant': False"):
        grads(model, use_reentrant=True)


def carries(model) -> list[weakref.ref]:
    """Weak references to every carry a decoder layer receives (a hook reads it from the kwargs)."""
    refs: list[weakref.ref] = []
    model.model.layers[1].register_forward_pre_hook(
        lambda m, a, kw: refs.append(weakref.ref(kw[CARRY_KWARG])), with_kwargs=True
    )
    return refs


@pytest.mark.parametrize("checkpointing", [False, True])
def test_nothing_outlives_a_forward(checkpointing: bool) -> None:
    model = build().train()
    apply_alignment(model, regions="all", engine="vllm")
    refs = carries(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss = model(IDS).logits.float().logsumexp(-1).sum()
    assert forwards.CARRY_ATTR not in model.model.norm.__dict__
    box = refs[0]()
    if not checkpointing:  # every remainder was popped by its reader and the carry is gone with the forward
        assert box is None
    else:  # the recompute in backward reads the layer inputs' remainders again: the graph holds them
        assert len(box) == LAYERS - 1
        rests = [weakref.ref(t) for t in box._rest.values()]
        del box
        loss.backward()
        del loss
        gc.collect()
        assert refs[0]() is None and all(r() is None for r in rests)
    with torch.no_grad():
        model(IDS)
    gc.collect()
    # transformers < 5.23 recomputes a checkpointed layer through the module's __call__ (its pre-hook sees the
    # first forward's carry again); >= 5.23 checkpoints inside the class's forward, where no module hook runs
    recompute_runs_hooks = Version(transformers.__version__) < Version("5.23")
    assert len(refs) == (3 if checkpointing and recompute_runs_hooks else 2)
    assert all(r() is None for r in refs)


@pytest.mark.parametrize(
    ("profile", "regions", "tp"),
    [
        ("vllm", "all", 1),
        ("sglang", "all", 1),
        ("hf", "all", 1),
        ("vllm", "all,tp", 4),
        ("vllm-cpu", "all,tp", 2),
    ],
)
def test_generation_with_kv_cache_matches_the_aligned_forward(profile: str, regions: str, tp: int) -> None:
    """The KV cache keeps working with every profile, and with the tp region's split projections."""
    model = build()
    apply_alignment(model, regions=regions, engine=profile, rollout_tp=tp)
    prompt = IDS[:1]
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        full = model(out.sequences).logits[0, prompt.shape[1] - 1 : -1].float()
        no_cache = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(out.sequences, no_cache)
    step = torch.cat(out.logits).float()
    assert torch.equal(step.argmax(-1), full.argmax(-1))
    # one token at a time vs the whole sequence: other matmul shapes, so the bf16 logits may differ in the
    # last bit (2^-7 relative) and the fp32 accumulations before it by a few ulps
    torch.testing.assert_close(step, full, rtol=2**-6, atol=2**-6 * float(full.abs().max()))


def test_layer_called_without_the_carry_raises_and_removal_restores() -> None:
    model = build()
    apply_alignment(model, regions="all", engine="vllm")
    x = torch.randn(1, 3, H, dtype=BF)
    pos = torch.arange(3)[None]
    emb = model.model.rotary_emb(x, pos)
    with pytest.raises(AlignmentError, match="call the model"):
        model.model.layers[0](x, position_embeddings=emb, position_ids=pos)
    apply_alignment(model, regions="all", engine="vllm")  # idempotent
    keys = {k: v.dtype for k, v in model.state_dict().items()}
    remove_alignment(model)
    assert {k: v.dtype for k, v in model.state_dict().items()} == keys
    assert not any("forward" in m.__dict__ for m in model.modules())
    model.model.layers[0](x, position_embeddings=emb, position_ids=pos)
