"""Checks done before anything expensive: the model directory, the engine profile of the rollouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlalign_verl.base.errors import (
    AlignmentError,
    ProfileMismatchError,
    UnsupportedModelError,
    VocabularyMismatchError,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model(model_dir: Path) -> tuple[Any, Any]:
    """``(config, tokenizer)`` of a supported HF checkpoint directory, or a one-line error."""
    from transformers import AutoConfig, AutoTokenizer

    from rlalign_verl.catalog.families import SUPPORTED_MODEL_TYPES

    if not (model_dir / "config.json").is_file():
        raise AlignmentError(
            f"{model_dir} is not a HF checkpoint directory (no config.json); pass --model DIR"
        )
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign config.json: one user-facing problem
        raise AlignmentError(
            f"cannot read {model_dir / 'config.json'} ({type(e).__name__}); pass --model DIR"
        ) from e
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} ({model_dir}) is not supported by rlalign-verl diagnose "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use one of those architectures or --tiny"
        )
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer here instead of failing
        raise AlignmentError(
            f"{model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); put the checkpoint's "
            "tokenizer files next to the weights"
        )
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - any loader failure is the same user-facing problem
        raise AlignmentError(
            f"cannot load the tokenizer of {model_dir} ({type(e).__name__}); put the checkpoint's tokenizer files next to the weights"
        ) from e
    if len(tok) > config.vocab_size:
        raise VocabularyMismatchError(
            f"the tokenizer of {model_dir} has {len(tok)} tokens but the model's vocabulary is "
            f"{config.vocab_size}: tokenizer and weights come from different checkpoints; put the matching "
            f"tokenizer files next to the weights"
        )
    return config, tok


def profile_for_engine(name: str | None, dist: tuple[str, str]) -> Any:
    """The profile of rollouts sampled here by the installed CPU engine."""
    from rlalign_verl.catalog.profiles import get_profile

    profile = get_profile(name or "vllm-cpu")
    if not (profile.engine == "vllm" and profile.device == "cpu"):
        raise ProfileMismatchError(
            f"--engine {profile.name} describes {profile.engine} on {profile.device}, but the engine installed "
            f"here is {dist[0]} {dist[1]} (CPU); use --engine vllm-cpu (compiled, default) or vllm-cpu-eager, "
            f"or generate the rollouts with {profile.name} on its machine and pass them with --rollout-logprobs"
        )
    return profile


def profile_for_dump(name: str | None, header: Any, path: Path) -> Any:
    """The profile of a rollout dump: its header's, or ``--engine`` when it agrees."""
    from rlalign_verl.catalog.profiles import PROFILES, get_profile

    if name is None:
        if header.profile not in PROFILES:
            raise ProfileMismatchError(
                f"{path} was made by {header.engine} {header.engine_version} ({header.mode}) with profile "
                f"{header.profile!r}, which rlalign-verl does not know; pass --engine with one of {', '.join(PROFILES)}"
            )
        return get_profile(header.profile)
    profile = get_profile(name)
    if profile.name != header.profile:
        raise ProfileMismatchError(
            f"--engine {profile.name} contradicts {path}: its rollouts come from {header.engine} "
            f"{header.engine_version} in {header.mode} mode (profile {header.profile}); drop --engine or pass "
            f"--engine {header.profile}"
        )
    return profile


def check_settings(settings: list, profile: Any, tp: int = 1, config: Any = None) -> None:
    """Refuse (one line, before the engine samples or anything is recomputed) a ``--settings`` entry the profile
    cannot run at the rollout's tensor-parallel size ``tp`` on the model (``config``: its architecture)."""
    from rlalign_verl.request.checks import validate_request
    from rlalign_verl.request.spec import AlignmentSpec

    model_type = getattr(config, "model_type", None)
    for label, regions in settings:
        spec = AlignmentSpec.parse(regions=regions, engine=profile.name, rollout_tp=tp)
        try:
            validate_request(spec, model_type=model_type, model_config=config)
        except AlignmentError as err:
            raise type(err)(
                f"--settings {label} (profile {profile.name}, tensor parallel {tp}): {err}"
            ) from None
