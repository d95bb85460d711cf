"""Tiny, deterministic, locally built HF checkpoints (Qwen2, Qwen3, Llama) for tests and the default demo.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here with the ``tokenizers`` library
on a small built-in corpus, and the weights are drawn from a seeded generator. The same
``(arch, seed)`` gives byte-identical files on every build. The checkpoints load in
``transformers`` (``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)``) and in the vLLM
CPU engine (head_dim 64, which vLLM's CPU attention supports).

Weight scale: linear weights are normal with std 0.08 and the output head with a larger std, so
next-token distributions are confident but not one-hot and per-token log-prob gaps are meaningful.
RMSNorm weights are drawn around 1 (not exactly 1) so that the norm's weight multiply rounds like
in a trained model.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

TINY_VERSION = 1
"""Bump when the recipe changes: the cache directory name carries it."""

TINY_ARCHS: tuple[str, ...] = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")

VOCAB_SIZE = 1024
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

PRETOKENIZE_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
"""Qwen2's pre-tokenizer split (digits one by one)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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


# --- tokenizer ---------------------------------------------------------------------------------

_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model learns to count, to add numbers and to
answer short questions. Reinforcement learning from verifiable rewards samples answers from a policy,
scores them, and updates the policy with a clipped objective. The inference engine and the training
engine compute the same network, but they round intermediate values to bfloat16 in different places,
so the log-probabilities they report for the same tokens differ a little. Rotary position embeddings
rotate pairs of query and key features by an angle that grows with the position. The gated linear
unit multiplies the SiLU of the gate projection with the up projection. Root mean square normalization
divides each hidden vector by its root mean square and scales it by a learned weight. The residual
stream carries the sum of every layer's output to the next layer.
Question: what is two plus three? Answer: five. Question: what is seven minus four? Answer: three.
Once upon a time there was a little robot who liked to sort coloured stones by size and weight.
Every morning it walked to the river, picked up the stones, and counted them one by one.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
"""

_WORDS = (
    "the a an one two three four five six seven eight nine ten model policy reward token prompt answer "
    "question engine train rollout value number sum product step batch layer head vector matrix weight "
    "river stone robot morning evening count sort size small large first last next previous is was are "
    "will can should must and or but if then else because while when where what which who how why "
    "red green blue yellow black white cat dog bird fish tree house road city country world time day "
    "year math code python function return print list dict string float integer gradient loss learn"
).split()


def tiny_corpus() -> list[str]:
    """The built-in training text: a fixed paragraph plus seeded sentences, arithmetic and code lines."""
    rng = random.Random(1234)
    lines = _TEXT.splitlines()
    syll = "ka ro mi tu ne sa li po ver dan qui zor el ath ung ish".split()
    pseudo = ["".join(rng.choice(syll) for _ in range(rng.randint(2, 3))) for _ in range(400)]
    vocab = list(_WORDS) + pseudo
    for _ in range(3000):
        n = rng.randint(5, 14)
        words = [rng.choice(vocab) for _ in range(n)]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    for _ in range(600):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        res = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a} {op} {b} = {res}")
    for _ in range(200):
        name = rng.choice(_WORDS)
        lines.append(f"def {name}_{rng.randint(0, 99)}(x, y):\n    return x {rng.choice('+-*')} y  # {name}")
    return lines


def train_tiny_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer trained on :func:`tiny_corpus`, wrapped as ``PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # The same normalizer / pre-tokenizer / decoder as transformers' Qwen2Tokenizer, which
    # AutoTokenizer substitutes for model_type qwen2: every loader then tokenizes identically.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


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
        from .tiny_moe import moe_config

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


def _is_complete(path: Path, arch: str, seed: int) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("version") == TINY_VERSION and info.get("arch") == arch and info.get("seed") == seed


def build_tiny_checkpoint(arch: str = "qwen2", path: str | Path | None = None, *, seed: int = 0) -> Path:
    """Build (or reuse) the tiny ``arch`` checkpoint and return its directory.

    ``path`` defaults to ``<cache>/<arch>-v<TINY_VERSION>`` (seed 0) or ``<arch>-s<seed>-v<N>``. An
    existing complete build there is reused. The build is written to a temporary sibling directory
    and renamed into place, so an interrupted build never leaves a half-written checkpoint.
    """
    if arch not in SPECS:
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"no tiny model for architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}"
        )
    spec = SPECS[arch]
    if path is None:
        name = f"{arch}-v{TINY_VERSION}" if seed == 0 else f"{arch}-s{seed}-v{TINY_VERSION}"
        path = tiny_cache_root() / name
    path = Path(path).expanduser().resolve()
    if _is_complete(path, arch, seed):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        _write_checkpoint(tmp, spec, seed)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any checkpoint
        if path.exists():
            # incomplete or stale build: replace it
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.replace(tmp, path)
        except OSError:
            if _is_complete(path, arch, seed):  # another process won the race
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
        from .tiny_moe import per_expert_keys

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


# --- prompts -----------------------------------------------------------------------------------

_PROMPTS = (
    "Question: what is two plus three? Answer:",
    "Once upon a time there was a little robot",
    "The inference engine and the training engine",
    "def add(a, b):\n    return",
    "Rotary position embeddings rotate pairs of",
    "The residual stream carries the sum of",
    "Every morning it walked to the river,",
    "12 + 30 =",
    "Reinforcement learning from verifiable rewards",
    "The gated linear unit multiplies the",
    "for i in range(10):\n    print(",
    "A small model learns to count,",
)


def tiny_prompts(tokenizer, n: int, *, seed: int = 0) -> list[list[int]]:
    """``n`` deterministic prompts as token-id lists (fixed sentences, then seeded word sequences)."""
    rng = random.Random(seed)
    texts = list(_PROMPTS)
    while len(texts) < n:
        k = rng.randint(4, 16)
        texts.append(" ".join(rng.choice(_WORDS) for _ in range(k)).capitalize())
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts[:n]]


def checkpoint_digest(path: str | Path) -> str:
    """sha256 over the files of a checkpoint directory (names and bytes), for reproducibility checks."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()
