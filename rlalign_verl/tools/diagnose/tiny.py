"""Tiny, deterministic, locally built HF checkpoints (Qwen2, Qwen3, Llama) for tests and the default demo.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here with the ``tokenizers`` library
on a small built-in corpus (:mod:`.tiny_text`: corpus, tokenizer, prompts), and the weights are drawn
from a seeded generator. The same ``(arch, seed)`` gives byte-identical files on every build. The
checkpoints load in ``transformers`` (``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)``)
and in the vLLM CPU engine (head_dim 64, which vLLM's CPU attention supports).

Weight scale: linear weights are normal with std 0.08 and the output head with a larger std, so
next-token distributions are confident but not one-hot and per-token log-prob gaps are meaningful.
RMSNorm weights are drawn around 1 (not exactly 1) so that the norm's weight multiply rounds like
in a trained model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rlalign_verl.tools.diagnose.tiny_text import EOS_TOKEN, VOCAB_SIZE, train_tiny_tokenizer
from rlalign_verl.tools.diagnose.tiny_text import (
    tiny_prompts as tiny_prompts,  # re-exported: callers import it from this module
)

TINY_VERSION = 1
"""Bump when the recipe changes: the cache directory name carries it."""

TINY_ARCHS: tuple[str, ...] = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class TinySpec:
    """Shape of one tiny architecture."""

    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    weight_std: float = 0.08
    embed_std: float = 0.5
    lm_head_std: float = 0.25
    num_experts: int = 0
    """MoE only: routed experts per layer, ``top_k`` of them per token, each of width ``moe_intermediate``."""
    top_k: int = 0
    moe_intermediate: int = 0
    shared_expert_intermediate: int = 0
    """Qwen2-MoE: the sigmoid-gated shared expert's width."""


SPECS: dict[str, TinySpec] = {
    # Qwen2: head_dim is hidden / heads; q/k/v projections carry a bias.
    "qwen2": TinySpec("qwen2", 256, 704, 4, 4, 2, 64, rope_theta=1_000_000.0),
    # Qwen3: non-power-of-two hidden size; explicit head_dim (attention width 256 != hidden 320), q/k norm.
    "qwen3": TinySpec("qwen3", 320, 864, 4, 4, 2, 64, rope_theta=1_000_000.0),
    # Llama: 6 heads of 64 = 384 (non-power-of-two), rope_theta 10000 as in Llama 2.
    "llama": TinySpec("llama", 384, 1024, 4, 6, 2, 64, rope_theta=10_000.0),
    # MoE: 8 experts, top-2, every layer sparse; widths multiples of 32 (vLLM's CPU expert kernels).
    "qwen3_moe": TinySpec(
        "qwen3_moe",
        256,
        512,
        4,
        4,
        2,
        64,
        rope_theta=1_000_000.0,
        num_experts=8,
        top_k=2,
        moe_intermediate=256,
    ),
    "qwen2_moe": TinySpec(
        "qwen2_moe",
        256,
        512,
        4,
        4,
        2,
        64,
        rope_theta=1_000_000.0,
        num_experts=8,
        top_k=2,
        moe_intermediate=256,
        shared_expert_intermediate=512,
    ),  # fmt: skip
}


# --- weights -----------------------------------------------------------------------------------


def _make_config(spec: TinySpec, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.weight_std,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="bfloat16",
    )
    if spec.arch == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=False)
        cls = "Qwen2ForCausalLM"
    elif spec.arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=spec.head_dim, attention_bias=False, use_sliding_window=False)
        cls = "Qwen3ForCausalLM"
    elif spec.arch == "llama":
        cfg = LlamaConfig(**common, head_dim=spec.head_dim, attention_bias=False, mlp_bias=False)
        cls = "LlamaForCausalLM"
    else:
        from rlalign_verl.tools.diagnose.tiny_moe import moe_config

        cfg, cls = moe_config(spec, common)
    cfg.architectures = [cls]
    return cfg


def _param_std(name: str, spec: TinySpec) -> float:
    if name.endswith("embed_tokens.weight"):
        return spec.embed_std
    if name.startswith("lm_head"):
        return spec.lm_head_std
    if name.endswith(".bias"):
        return 0.1
    return spec.weight_std


def _tiny_state_dict(config, spec: TinySpec, seed: int) -> dict:
    """Every parameter of the HF model for ``config``, drawn deterministically, in bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out = {}
    for name, p in sorted(model.state_dict().items()):
        gen = torch.Generator().manual_seed(
            seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
        )
        if "norm" in name:
            # RMSNorm weights: around 1, but not 1, so the weight multiply rounds.
            t = 1.0 + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float32)
        else:
            t = torch.randn(p.shape, generator=gen, dtype=torch.float32) * _param_std(name, spec)
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def tiny_model(spec: TinySpec, *, vocab_size: int = VOCAB_SIZE, seed: int = 0, dtype=None, attn="sdpa"):
    """The HF model of ``spec`` with this recipe's seeded weights, built in memory (no tokenizer, no files)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _make_config(spec, vocab_size, eos_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.bfloat16, attn_implementation=attn)
    model.load_state_dict(_tiny_state_dict(config, spec, seed))
    return model


# --- build / cache -----------------------------------------------------------------------------


def tiny_cache_root() -> Path:
    """``$RLALIGN_CACHE/tiny`` if set, else ``~/.cache/rlalign-verl/tiny``."""
    env = os.environ.get("RLALIGN_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "rlalign-verl"
    return base / "tiny"


_MARKER = "rlalign_tiny.json"


def _is_complete(path: Path, spec: TinySpec, seed: int) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    same = info.get("arch") == spec.arch and info.get("spec") == json.loads(json.dumps(asdict(spec)))
    return info.get("version") == TINY_VERSION and same and info.get("seed") == seed


def build_tiny_checkpoint(
    arch: str = "qwen2", path: str | Path | None = None, *, seed: int = 0, spec: TinySpec | None = None
) -> Path:
    """Build (or reuse) the tiny ``arch`` checkpoint and return its directory.

    ``path`` defaults to ``<cache>/<arch>-v<TINY_VERSION>`` (seed 0) or ``<arch>-s<seed>-v<N>``. An
    existing complete build there is reused. The build is written to a temporary sibling directory
    and renamed into place, so an interrupted build never leaves a half-written checkpoint. ``spec``: another
    shape of ``arch`` (e.g. another width), built into ``path`` (required then).
    """
    if arch not in SPECS:
        from rlalign_verl.base.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"no tiny model for architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}"
        )
    if spec is not None and (spec.arch != arch or path is None):
        raise ValueError(f"a spec of {spec.arch} needs arch={spec.arch!r} and its own path")
    spec = spec or SPECS[arch]
    if path is None:
        name = f"{arch}-v{TINY_VERSION}" if seed == 0 else f"{arch}-s{seed}-v{TINY_VERSION}"
        path = tiny_cache_root() / name
    path = Path(path).expanduser().resolve()
    if _is_complete(path, spec, seed):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        _write_checkpoint(tmp, spec, seed)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any checkpoint
        if _is_complete(path, spec, seed):  # another process (a parallel test lane) finished it meanwhile
            return path
        if path.exists():
            # incomplete or stale build: replace it
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.replace(tmp, path)
        except OSError:
            if _is_complete(path, spec, seed):  # another process won the race
                return path
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_checkpoint(out: Path, spec: TinySpec, seed: int) -> None:
    from safetensors.torch import save_file

    tokenizer = train_tiny_tokenizer()
    vocab_size = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = _make_config(spec, vocab_size, eos_id)
    state = _tiny_state_dict(config, spec, seed)
    if spec.num_experts:
        from rlalign_verl.tools.diagnose.tiny_moe import per_expert_keys

        state = per_expert_keys(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}, indent=2) + "\n"
    )
    info = {
        "version": TINY_VERSION,
        "arch": spec.arch,
        "seed": seed,
        "spec": asdict(spec),
        "vocab_size": vocab_size,
    }
    (out / _MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def checkpoint_digest(path: str | Path) -> str:
    """sha256 over the files of a checkpoint directory (names and bytes), for reproducibility checks."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()
