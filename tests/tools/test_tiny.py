"""The tiny local checkpoints: loadable by transformers, deterministic, realistic shapes and confidence."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from rlalign_verl.base.errors import UnsupportedModelError
from rlalign_verl.tools.diagnose.tiny import (
    SPECS,
    TINY_ARCHS,
    build_tiny_checkpoint,
    checkpoint_digest,
    tiny_prompts,
)

VLLM_CPU_HEAD_DIMS = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_builds_are_byte_identical(tmp_path):
    a = build_tiny_checkpoint("qwen3", tmp_path / "a")
    b = build_tiny_checkpoint("qwen3", tmp_path / "b")
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    assert _sha(a / "tokenizer.json") == _sha(b / "tokenizer.json")
    assert checkpoint_digest(a) == checkpoint_digest(b)
    c = build_tiny_checkpoint("qwen3", tmp_path / "c", seed=1)
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")
    # no temporary build directory is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]


def test_reuses_complete_build_and_rebuilds_incomplete(tmp_path):
    p = build_tiny_checkpoint("llama", tmp_path / "m")
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_checkpoint("llama", p) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime
    (p / "rlalign_tiny.json").unlink()  # looks like an interrupted build
    build_tiny_checkpoint("llama", p)
    assert (p / "rlalign_tiny.json").is_file()


def test_cache_location_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RLALIGN_CACHE", str(tmp_path))
    p = build_tiny_checkpoint("qwen2")
    assert p.parent == tmp_path / "tiny" and p.name.startswith("qwen2-v")


def test_unknown_arch_is_a_clear_error(tmp_path):
    with pytest.raises(UnsupportedModelError, match="qwen2, qwen3, llama"):
        build_tiny_checkpoint("mistral", tmp_path / "x")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_loads_in_hf_with_expected_shapes(arch, tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    path = tiny_checkpoint(arch)
    spec = SPECS[arch]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.vocab_size == len(tok) == 1024
    assert cfg.tie_word_embeddings is False
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head_dim == spec.head_dim and head_dim in VLLM_CPU_HEAD_DIMS
    assert cfg.hidden_size == spec.hidden_size and cfg.num_key_value_heads == spec.num_kv_heads
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # the RMSNorm weights are not all ones (so the weight multiply rounds as in a trained model)
    assert not torch.all(model.model.norm.weight == 1)
    # every loader tokenizes identically (AutoTokenizer picks Qwen2Tokenizer for qwen2)
    plain = PreTrainedTokenizerFast.from_pretrained(path)
    for text in ["12 + 30 = 42", "def add(a, b):\n    return a + b", "Héllo wörld <|im_end|>"]:
        assert tok(text)["input_ids"] == plain(text)["input_ids"]
    assert tok.eos_token_id == tok.pad_token_id == cfg.eos_token_id
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_predictions_are_confident_but_not_one_hot(arch, tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoint(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = tiny_prompts(tok, 8)
    width = max(map(len, prompts))
    ids = torch.tensor([p + [tok.pad_token_id] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    with torch.no_grad():
        logp = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)[mask.bool()]
    top = logp.exp().max(-1).values[mask.bool()]
    # log(1024) = 6.93 for a flat distribution
    assert 0.5 < entropy.mean().item() < 4.0, entropy.mean()
    assert 0.2 < top.mean().item() < 0.9, top.mean()


def test_prompts_are_deterministic_and_in_vocab(tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    a, b = tiny_prompts(tok, 40), tiny_prompts(tok, 40)
    assert a == b and len(a) == 40
    assert all(4 <= len(p) <= 64 for p in a)
    assert max(max(p) for p in a) < len(tok)
    assert len({tuple(p) for p in a}) == 40


def test_marker_records_the_recipe(tiny_checkpoint):
    info = json.loads((tiny_checkpoint("qwen3") / "rlalign_tiny.json").read_text())
    assert info["arch"] == "qwen3" and info["spec"]["hidden_size"] == SPECS["qwen3"].hidden_size
