"""One model-level benchmark setting's pieces: model sizes, variants, the model, its inputs, one step."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from rlalign_verl.align.patch import apply_alignment, remove_alignment

MODES = ("train", "train-gc", "logprob")
DTYPES = ("bf16", "fp32+autocast")
LAYOUTS = ("padded", "packed")


@dataclass(frozen=True)
class Size:
    """One model shape and the tokens fed to it (``batch`` sequences of up to ``seq`` tokens)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seq: int
    batch: int
    vocab: int = 4096


@dataclass(frozen=True)
class Variant:
    """``hf`` (unaligned) or one profile with some regions."""

    name: str
    profile: str | None = None
    regions: tuple[str, ...] = ()


def variants_for(profiles: list[str], per_region: list[str]) -> list[Variant]:
    """``hf``, each region alone for the ``per_region`` profiles, and all regions for every profile."""
    out = [Variant("hf")]
    for p in profiles:
        if p in per_region:
            out += [Variant(f"{p}:{r}", p, (r,)) for r in ("rope", "swiglu", "rmsnorm")]
        out.append(Variant(f"{p}:all", p, ("rope", "swiglu", "rmsnorm")))
    return out


def build_model(size: Size, param_dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """A Qwen2-style causal LM of ``size`` with the tiny checkpoints' seeded weights (norm weights around 1)."""
    from rlalign_verl.tools.diagnose.tiny import TinySpec, tiny_model

    spec = TinySpec("qwen2", size.hidden, size.intermediate, size.layers, size.heads, size.kv_heads,
                    size.hidden // size.heads, rope_theta=1_000_000.0, max_position_embeddings=max(4096, size.seq),
                    weight_std=0.05, embed_std=0.05, lm_head_std=0.05)  # fmt: skip
    return tiny_model(spec, vocab_size=size.vocab, seed=seed, dtype=param_dtype).to(device)


def make_inputs(size: Size, layout: str, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, labels, a loss mask and either an attention mask (padded) or restarting position_ids (packed).

    Both layouts hold the same sequence lengths (between half and all of ``seq``).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(size.seq // 2, size.seq + 1, (size.batch,), generator=g)
    lengths[0] = size.seq
    if layout == "padded":
        ids = torch.randint(0, size.vocab, (size.batch, size.seq), generator=g)
        mask = (torch.arange(size.seq)[None, :] < lengths[:, None]).long()
        inputs = {"input_ids": ids, "attention_mask": mask}
        loss_mask = mask
    elif layout == "packed":
        total = int(lengths.sum())
        ids = torch.randint(0, size.vocab, (1, total), generator=g)
        pos = torch.cat([torch.arange(int(n)) for n in lengths])[None, :]
        inputs = {"input_ids": ids, "position_ids": pos}
        loss_mask = torch.ones(1, total, dtype=torch.long)
    else:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    labels = torch.roll(inputs["input_ids"], -1, dims=1)
    out = {**inputs, "labels": labels, "loss_mask": loss_mask}
    return {k: v.to(device) for k, v in out.items()}


def log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token log-probs of the labels, fp32 (as verl's ``logprobs_from_logits``)."""
    kwargs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    logits = model(**kwargs, use_cache=False).logits
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)


def step_fn(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], mode: str, autocast: bool
) -> Callable[[], None]:
    """One measured step: train (forward + loss + backward, gradients freed first) or no-grad log-probs."""
    device_type = next(model.parameters()).device.type
    amp = (lambda: torch.autocast(device_type, dtype=torch.bfloat16)) if autocast else nullcontext
    mask = batch["loss_mask"].float()

    def train() -> None:
        model.zero_grad(set_to_none=True)
        with amp():
            lp = log_probs(model, batch)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()

    def logprob() -> None:
        with torch.no_grad(), amp():
            log_probs(model, batch)

    return logprob if mode == "logprob" else train


def forward_only(model: torch.nn.Module, batch: dict[str, torch.Tensor], autocast: bool) -> torch.Tensor:
    """The training forward without backward: its result keeps every tensor saved for backward alive."""
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=torch.bfloat16) if autocast else nullcontext():
        return log_probs(model, batch)


def set_mode(model: torch.nn.Module, mode: str) -> None:
    """train / train-gc (HF gradient checkpointing, non-reentrant as verl) / logprob (eval)."""
    if mode == "train-gc":
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
        model.train(mode == "train")


def set_variant(model: torch.nn.Module, v: Variant) -> None:
    """Switch the same model instance to ``v``: alignment removed, then applied with ``v``'s regions."""
    remove_alignment(model)
    if v.profile is not None:
        apply_alignment(model, regions=v.regions, engine=v.profile)
