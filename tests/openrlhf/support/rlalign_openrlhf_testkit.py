"""Helpers for the OpenRLHF tests that must be importable inside Ray workers (test code only).

The conftest puts this folder on ``PYTHONPATH`` before Ray starts, so classes defined here are
pickled by reference and imported by name in the workers.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import ray
import torch


class _RankZero:
    """The only strategy method ``BaseModelActor.execute_batch`` calls."""

    @staticmethod
    def is_rank_0() -> bool:
        return True


def plugin_state() -> dict[str, Any]:
    """What the plugin installed in this process."""
    from openrlhf.models.actor import Actor
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    from rlalign_verl.openrlhf.setup import active_settings

    s = active_settings()
    return {
        "pid": os.getpid(),
        "settings": None
        if s is None
        else (s.regions, s.profile, s.metrics, s.collect_rollout_logprobs, s.auto),
        "actor_wrapped": bool(getattr(Actor.__init__, "_rlalign_wrapped", False)),
        "experience_maker_wrapped": bool(
            getattr(RemoteExperienceMaker.make_experience_batch, "_rlalign_wrapped", False)
        ),
        "env": {k: v for k, v in os.environ.items() if k.startswith("RLALIGN_")},
    }


@ray.remote
def remote_plugin_state() -> dict[str, Any]:
    """:func:`plugin_state` in a Ray task worker."""
    return plugin_state()


def _import_base_model_actor():
    from openrlhf.trainer.ray.launcher import BaseModelActor

    return BaseModelActor


@ray.remote(num_gpus=0)
class CpuModelActor(_import_base_model_actor()):
    """An OpenRLHF model actor on CPU: builds a real ``openrlhf.models.Actor`` (what the policy and
    reference actors build, minus DeepSpeed, which needs CUDA) and serves ``forward`` to
    ``RayActorGroup.async_run_method_batch`` like ``ReferenceModelActor`` does."""

    def init_model_from_pretrained(self, pretrain: str, temperature: float = 1.0) -> None:
        from openrlhf.models import Actor

        torch.set_num_threads(1)
        self.strategy = _RankZero()
        self.model = Actor(pretrain, attn_implementation="sdpa", param_dtype="bf16", temperature=temperature)
        self.model.eval()

    @torch.no_grad()
    def forward(self, sequences, action_mask=None, attention_mask=None, **_: Any) -> torch.Tensor:
        return self.model(sequences, action_mask, attention_mask=attention_mask).to("cpu")

    def alignment(self) -> tuple[tuple[str, ...], str] | None:
        from rlalign_verl.align.patch import get_alignment

        state = get_alignment(self.model.model)
        return None if state is None else (state.regions, state.profile.name)

    def state(self) -> dict[str, Any]:
        return plugin_state()


class _Captured(Exception):
    def __init__(self, args: Any) -> None:
        super().__init__("captured")
        self.captured = args


def capture_openrlhf_args(argv: Sequence[str]) -> Any:
    """OpenRLHF's own parsed and validated ``args`` for ``argv``: runs ``openrlhf.cli.train_ppo_ray`` as
    ``__main__`` and stops it at its first call after validation (``get_strategy``)."""
    import openrlhf.utils as utils

    original = utils.get_strategy

    def stop(args: Any) -> None:
        raise _Captured(args)

    saved_argv = sys.argv
    utils.get_strategy = stop
    sys.argv = ["train_ppo_ray", *argv]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    except _Captured as captured:
        return captured.captured
    finally:
        utils.get_strategy = original
        sys.argv = saved_argv
    raise AssertionError("openrlhf.cli.train_ppo_ray returned without calling get_strategy")


@contextlib.contextmanager
def plugin_settings(settings: Any) -> Iterator[None]:
    """Run a block with other plugin settings active in this process, then restore the previous ones."""
    from rlalign_verl.openrlhf import setup

    previous = setup.active_settings()
    setup.install(settings)
    try:
        yield
    finally:
        if previous is not None:
            setup.install(previous)
        else:
            setup._active = None


@ray.remote(num_cpus=0)
class EngineDouble:
    """Stands in for OpenRLHF's vLLM engine actor (vLLM cannot run here): records the sampling params
    ``SamplesGenerator`` sends and answers like ``LLMRayActor.generate_responses`` with no output."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def get_num_unfinished_requests(self) -> int:
        return 0

    def generate_responses(
        self, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples, images
    ):
        self.calls.append({"prompt": prompt, "logprobs": getattr(sampling_params, "logprobs", "absent")})
        return []

    def recorded(self) -> list[dict[str, Any]]:
        return self.calls
