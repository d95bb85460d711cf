"""OpenRLHF's ``Actor`` under the plugin: aligned inside a Ray worker, equal to ``apply_alignment``."""

from __future__ import annotations

import pytest

pytest.importorskip("openrlhf")

import torch  # noqa: E402
from recompute_threads import single_thread  # noqa: E402

from rlalign_verl.align.patch import apply_alignment, get_alignment  # noqa: E402
from rlalign_verl.base.errors import LigerConflictError, ProfileMismatchError, UnsupportedModelError  # noqa: E402
from rlalign_verl.openrlhf.settings import Settings  # noqa: E402

OFF = Settings.build(regions=(), metrics=False)


def batch(vocab_size: int, seed: int = 0):
    """Two sequences in OpenRLHF's layout: right-padded, action mask over the shifted response."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(3, vocab_size, (2, 24), generator=g)
    attention = torch.ones_like(seqs)
    attention[1, 20:] = 0  # second sample is 4 tokens shorter
    seqs[1, 20:] = 0
    action = attention[:, 1:].clone()
    action[:, :9] = 0  # prompt: first 10 tokens
    return seqs, attention, action


def log_probs(actor, seqs, attention, action):
    with torch.no_grad(), single_thread():
        return actor(seqs, action, attention_mask=attention)


@pytest.fixture(scope="module")
def reference(tiny_qwen2):
    """Driver-side log-probs: the same checkpoint unaligned, then with ``apply_alignment``."""
    from openrlhf.models import Actor
    from rlalign_openrlhf_testkit import plugin_settings

    with plugin_settings(OFF):
        actor = Actor(str(tiny_qwen2), attn_implementation="sdpa", param_dtype="bf16")
    actor.eval()
    seqs, attention, action = batch(actor.model.config.vocab_size)
    unaligned = log_probs(actor, seqs, attention, action)
    apply_alignment(actor.model, regions=("rope", "swiglu", "rmsnorm"), engine="vllm-cpu")  # auto on this CPU
    aligned = log_probs(actor, seqs, attention, action)
    return {"inputs": (seqs, attention, action), "unaligned": unaligned, "aligned": aligned}


def test_actor_built_in_ray_worker_is_aligned(plugin_ray, tiny_qwen2, reference):
    import ray
    from openrlhf.trainer.ray.launcher import RayActorGroup
    from rlalign_openrlhf_testkit import CpuModelActor

    group = RayActorGroup(1, 1, CpuModelActor, num_gpus_per_actor=0)
    ray.get(group.async_init_model_from_pretrained(str(tiny_qwen2)))
    assert ray.get(group.async_run_method("alignment")) == [(("rope", "swiglu", "rmsnorm"), "vllm-cpu")]

    seqs, attention, action = reference["inputs"]
    (worker,) = ray.get(group.async_run_method("forward", seqs, action, attention))
    assert worker.shape == action.shape
    assert torch.equal(worker, reference["aligned"])
    gap = (reference["unaligned"] - reference["aligned"]).abs()
    assert gap.max().item() > 1e-4  # alignment changes the log-probs: the comparison can fail
    assert torch.all(worker[action == 0] == 0)
    for handle in group._actor_handlers:
        ray.kill(handle)


def test_driver_actor_aligned_once_with_one_log_line(plugin_ray, tiny_qwen2, reference, plugin_log):
    from openrlhf.models import Actor

    actor = Actor(str(tiny_qwen2), attn_implementation="sdpa", param_dtype="bf16")
    actor.eval()
    lines = [m for m in plugin_log if m.startswith("aligned ")]
    assert len(lines) == 1, plugin_log
    assert lines[0].startswith("aligned Qwen2ForCausalLM for Actor (pid ")
    assert "regions=['rope', 'swiglu', 'rmsnorm'] profile=vllm-cpu" in lines[0]  # auto, settled on this CPU
    assert torch.equal(log_probs(actor, *reference["inputs"]), reference["aligned"])


def test_lora_actor_aligns_the_base_model(plugin_ray, tiny_qwen2, reference):
    from openrlhf.models import Actor

    actor = Actor(
        str(tiny_qwen2),
        attn_implementation="sdpa",
        param_dtype="bf16",
        lora_rank=4,
        target_modules=["q_proj"],
    )
    actor.eval()
    state = get_alignment(actor.model.get_base_model())
    assert state is not None and state.regions == ("rope", "swiglu", "rmsnorm")
    # LoRA's B starts at zero: the output is the base model's
    assert torch.equal(log_probs(actor, *reference["inputs"]), reference["aligned"])


def test_critic_and_reward_models_are_not_aligned(plugin_ray, tiny_qwen2):
    from openrlhf.models import get_llm_for_sequence_regression

    critic = get_llm_for_sequence_regression(
        str(tiny_qwen2), "critic", param_dtype="bf16", attn_implementation="sdpa"
    )
    assert get_alignment(critic) is None


def test_liger_with_alignment_is_refused(plugin_ray, tiny_qwen2):
    from openrlhf.models import Actor

    with pytest.raises(LigerConflictError, match="drop --ds.use_liger_kernel"):
        Actor(str(tiny_qwen2), attn_implementation="sdpa", use_liger_kernel=True)


def test_explicit_cuda_profile_is_refused_on_this_cpu_before_the_checkpoint_loads(plugin_ray):
    from openrlhf.models import Actor
    from rlalign_openrlhf_testkit import plugin_settings

    explicit = Settings.build(regions=("rope",), profile="vllm", metrics=False)
    fix = r"profile vllm mirrors the vllm CUDA build but this model runs on a CPU-only worker; use alignment.engine=vllm-cpu"
    # a missing checkpoint: the placement error comes first, so nothing was loaded
    with plugin_settings(explicit), pytest.raises(ProfileMismatchError, match=fix):
        Actor("/nonexistent/checkpoint", attn_implementation="sdpa", param_dtype="bf16")


def test_unsupported_model_is_refused(plugin_ray, tiny_gpt2):
    from openrlhf.models import Actor

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        Actor(str(tiny_gpt2), attn_implementation="sdpa", param_dtype="bf16")


def test_without_regions_the_actor_is_untouched(plugin_ray, tiny_qwen2, reference):
    from openrlhf.models import Actor
    from rlalign_openrlhf_testkit import plugin_settings

    with plugin_settings(OFF):
        actor = Actor(str(tiny_qwen2), attn_implementation="sdpa", param_dtype="bf16")
    actor.eval()
    assert get_alignment(actor.model) is None
    assert torch.equal(log_probs(actor, *reference["inputs"]), reference["unaligned"])


def test_aligned_actor_under_deepspeed_zero3_matches(tiny_qwen2):
    """A real DeepSpeed ZeRO-3 engine (CPU, gloo, one rank) around the aligned Actor gives the same
    log-probs as without DeepSpeed: the aligned layers' direct reads of the partitioned RMSNorm weights
    are gathered (DeepSpeed registers them as external parameters on first access)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "support" / "zero3_logprobs.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tiny_qwen2)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    diffs = json.loads(result.stdout.strip().splitlines()[-1])
    assert diffs["zero3_vs_plain"] == 0.0
    assert diffs["aligned_vs_unaligned"] > 1e-4


def test_compiled_norm_setting_reaches_apply_alignment(plugin_ray, tiny_qwen2):
    """--alignment.compiled_norm: the Actor's model is aligned with compiled_norm=True (off: False)."""
    from openrlhf.models import Actor
    from rlalign_openrlhf_testkit import plugin_settings

    for on in (True, False):
        regions = ("rope", "swiglu", "rmsnorm")
        settings = Settings.build(regions=regions, profile="vllm-cpu", metrics=False, compiled_norm=on)
        with plugin_settings(settings):
            actor = Actor(str(tiny_qwen2), attn_implementation="sdpa", param_dtype="bf16")
        assert get_alignment(actor.model).compiled_norm is on
