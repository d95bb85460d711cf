"""What users do to an aligned model: compile, pickle, torch.save, deepcopy, reload the weights, change dtypes.

Each row either keeps the aligned logits bit for bit (and still reports itself aligned) or is refused in one
line; none may silently fall back to the unaligned numerics. ``reference`` is the eager aligned model itself;
``unaligned`` the same weights without alignment (every bit-exact row also checks that it differs from it,
so "aligned == unaligned" could never pass).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlalign_verl.align.patch import apply_alignment, get_alignment
from rlalign_verl.base.errors import ComputeDtypeError, UnsupportedModelError

BF = torch.bfloat16
IDS = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
ALL = ("rope", "swiglu", "rmsnorm")


def build(dtype: torch.dtype = BF) -> torch.nn.Module:
    cfg = Qwen2Config(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() > 1 else p.normal_(1.0, 0.2)
    return model.eval()


def logits(model, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, **kw).logits


@pytest.fixture(scope="module")
def aligned_and_reference() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    unaligned = logits(build())
    model = apply_alignment(build(), regions=ALL, engine="vllm")
    reference = logits(model)
    assert not torch.equal(reference, unaligned)  # the rows below can tell aligned from unaligned
    return model, reference, unaligned


def _pickled(model):
    return pickle.loads(pickle.dumps(model))


def _saved(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _state_dict_into_fresh_aligned(model):
    fresh = apply_alignment(build(), regions=ALL, engine="vllm")
    fresh.load_state_dict(model.state_dict())
    return fresh


@pytest.mark.parametrize(
    "transform",
    [copy.deepcopy, _pickled, _saved, _state_dict_into_fresh_aligned, torch.compile],
    ids=["deepcopy", "pickle", "torch.save/load", "state_dict into an aligned model", "torch.compile"],
)
def test_transformed_aligned_models_keep_the_aligned_logits(aligned_and_reference, transform):
    model, reference, unaligned = aligned_and_reference
    out = transform(model)
    got = logits(out)
    assert torch.equal(got, reference), (got.float() - reference.float()).abs().max()
    st = get_alignment(out)
    assert st is not None and set(st.regions) == set(ALL)


def test_save_pretrained_stores_weights_not_the_alignment(aligned_and_reference, tmp_path):
    """A checkpoint holds weights only: reloaded, the model is plain, says so, and re-aligns to the same bits."""
    model, reference, unaligned = aligned_and_reference
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=BF)
    assert get_alignment(reloaded) is None
    assert torch.equal(logits(reloaded), unaligned)
    assert torch.equal(logits(apply_alignment(reloaded, regions=ALL, engine="vllm")), reference)


def test_float16_models_are_refused_before_patching():
    model = build(torch.float16)
    with pytest.raises(UnsupportedModelError, match="float16") as e:
        apply_alignment(model, regions=ALL, engine="vllm")
    assert "\n" not in str(e.value) and "bfloat16" in str(e.value)
    assert get_alignment(model) is None


@pytest.mark.parametrize("regions", [("rope",), ("swiglu",), ("rmsnorm",), ALL])
def test_float32_compute_is_refused_at_the_first_forward(regions):
    """fp32 weights are fine where the compute is bf16 (FSDP mixed precision, autocast); an fp32 computation
    would only gain bf16 rounding points that match nothing, so the aligned forward refuses it in one line."""
    model = apply_alignment(build(torch.float32), regions=regions, engine="vllm")
    with pytest.raises(ComputeDtypeError, match="computes in float32") as e:
        logits(model)
    assert "\n" not in str(e.value) and "torch.autocast" in str(e.value)


def test_float32_weights_under_bf16_autocast_match_the_bf16_model():
    """The fp32-master-weights pattern (HF Trainer bf16=True): the regions see bf16 tensors and round as in bf16;
    the logits equal the bf16 aligned model's where the weights are the same bf16 values."""
    bf16 = apply_alignment(build(), regions=("rope", "swiglu"), engine="vllm")
    fp32 = build(torch.float32)
    fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    apply_alignment(fp32, regions=("rope", "swiglu"), engine="vllm")
    with torch.autocast("cpu", dtype=BF):
        mixed = logits(fp32)
    assert torch.isfinite(mixed).all()
    # same bf16 inputs to every region, fp32 residual stream around them: close to the bf16 model, not equal
    ref = logits(bf16).float()
    assert (mixed.float() - ref).abs().max() < 0.05 * ref.abs().max()
