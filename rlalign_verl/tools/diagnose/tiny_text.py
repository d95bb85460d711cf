"""The text side of the tiny-model recipe (see :mod:`.tiny`): corpus, tokenizer and prompts.

The tokenizer is a byte-level BPE trained here with the ``tokenizers`` library on a small built-in
corpus (nothing is downloaded); the same build gives the same vocabulary every time.
"""

from __future__ import annotations

import random

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
