"""``mismatch/*`` metrics on OpenRLHF's real experience path, and the measure-only mode."""

from __future__ import annotations

import inspect
import random

import pytest

pytest.importorskip("openrlhf")

import torch  # noqa: E402
from rlalign_openrlhf_testkit import plugin_settings  # noqa: E402

from rlalign_verl.openrlhf.settings import Settings  # noqa: E402

# 8 samples: the fewest a verdict (verify, the doctor's bias interval) is decided on
PROMPT_LENS = (5, 7, 4, 6, 3, 8, 5, 4)
RESPONSE_LENS = (6, 3, 8, 5, 4, 7, 2, 6)
METRIC_KEYS = {
    "mismatch/logp_abs_diff_mean",
    "mismatch/logp_abs_diff_max",
    "mismatch/kl_k3",
    "mismatch/ratio_max",
    "mismatch/ratio_clip_frac",
    "mismatch/num_tokens",
}


@pytest.fixture(scope="module")
def openrlhf_args(plugin_ray, tiny_qwen2):
    """OpenRLHF's own parsed, validated args (its real parser and defaults)."""
    from rlalign_openrlhf_testkit import capture_openrlhf_args

    return capture_openrlhf_args(
        [
            "--actor.model_name_or_path",
            str(tiny_qwen2),
            "--reward.remote_url",
            "http://localhost:1/unused",
            "--algo.advantage.estimator",
            "reinforce",
            "--rollout.micro_batch_size",
            "2",
            "--rollout.batch_size",
            "4",
            "--train.batch_size",
            "4",
            "--actor.eps_clip_low_high",
            "0.1",
            "0.3",
            "--actor.num_gpus_per_node",
            "1",
            "--ref.num_gpus_per_node",
            "1",
            "--vllm.num_engines",
            "1",
        ]
    )


@pytest.fixture(scope="module")
def policy_group(plugin_ray, tiny_qwen2):
    """The policy's log-prob forward in a Ray worker (a real, aligned ``openrlhf.models.Actor``)."""
    import ray
    from openrlhf.trainer.ray.launcher import RayActorGroup
    from rlalign_openrlhf_testkit import CpuModelActor

    group = RayActorGroup(1, 1, CpuModelActor, num_gpus_per_actor=0)
    ray.get(group.async_init_model_from_pretrained(str(tiny_qwen2)))
    yield group
    for handle in group._actor_handlers:
        ray.kill(handle)


def _engine_log_probs(tiny_qwen2, tokens: list[int]) -> list[float]:
    """Stand-in for vLLM's rollout log-probs: the unaligned bf16 HF model's log-prob of each token
    (0.0 for the first), i.e. another rounding of the same model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_qwen2), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits.float()[0, :-1]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0, *lp.tolist()]


@pytest.fixture(scope="module")
def rollout(openrlhf_args, tiny_qwen2):
    """Samples as OpenRLHF's ``SamplesGenerator`` turns vLLM responses into ``Experience`` objects."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.utils import get_strategy

    g = torch.Generator().manual_seed(1)
    generator = SamplesGenerator(get_strategy(openrlhf_args), None, None, None, [])
    samples, per_sample = [], []
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        tokens = torch.randint(3, 1000, (p + r,), generator=g).tolist()
        engine_lp = _engine_log_probs(tiny_qwen2, tokens)
        response = {
            "observation_tokens": tokens,
            "action_ranges": [(p, p + r)],
            "reward": float(i),
            "rollout_log_probs": engine_lp,
            "prompt": f"prompt {i}",
            "label": "",
        }
        samples.append(generator._process_response_into_experience(response, max_len=64))
        per_sample.append((tokens, p, r, engine_lp))
    return samples, per_sample


def _expected(per_sample, train_per_sample, clip_low, clip_high):
    """The statistics by hand, over the flat list of response tokens (no padding, no masks)."""
    d = []
    for (_, p, r, engine_lp), train in zip(per_sample, train_per_sample, strict=True):
        rollout = torch.tensor(engine_lp[p : p + r], dtype=torch.float64)
        d.append(train.double() - rollout)
    flat = torch.cat(d)
    ratio = flat.exp()
    return {
        "mismatch/logp_abs_diff_mean": flat.abs().mean().item(),
        "mismatch/logp_abs_diff_max": flat.abs().max().item(),
        "mismatch/kl_k3": (ratio - 1 - flat).mean().item(),
        "mismatch/ratio_max": ratio.max().item(),
        "mismatch/ratio_clip_frac": ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).double().mean().item(),
        "mismatch/num_tokens": float(flat.numel()),
    }


def test_experience_path_adds_mismatch_metrics(plugin_ray, openrlhf_args, policy_group, rollout, tiny_qwen2):
    import ray
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
    from openrlhf.utils import get_strategy
    from transformers import AutoTokenizer

    samples, per_sample = rollout
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen2))
    maker = RemoteExperienceMaker(
        policy_group, None, None, None, FixedKLController(0.0), get_strategy(openrlhf_args), tokenizer
    )
    with plugin_settings(_without_verification(plugin_ray)):  # verification: test_verify_pass_on_real_actors
        experiences = maker.make_experience_batch([s for s in samples])
    assert len(experiences) == len(PROMPT_LENS) // 2  # rollout micro batch size 2

    # the training side's log-probs of each response, straight from the worker's aligned Actor
    train = []
    for tokens, p, r, _ in per_sample:
        seq = torch.tensor([tokens])
        action = torch.ones(1, len(tokens) - 1, dtype=torch.long)
        (lp,) = ray.get(policy_group.async_run_method("forward", seq, action, torch.ones_like(seq)))
        train.append(lp[0, p - 1 : p - 1 + r])
    expected = _expected(per_sample, train, 0.1, 0.3)  # the clip range comes from --actor.eps_clip_low_high

    for exp in experiences:
        batch = exp.sequences.shape[0]
        assert METRIC_KEYS <= set(exp.info)
        for key in exp.info:
            if key.startswith("mismatch/"):
                value = exp.info[key]
                assert value.shape == (batch,) and torch.all(value == value[0])
    got = {k: experiences[0].info[k][0].item() for k in expected}
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # the doctor's signature rides along; its mean |Δ| is the headline gap computed another way
    doctor = {
        k: experiences[0].info[k][0].item() for k in experiences[0].info if k.startswith("mismatch/doctor/")
    }
    assert {"mismatch/doctor/bias", "mismatch/doctor/bias_lo", "mismatch/doctor/abs_mean"} <= set(doctor)
    assert doctor["mismatch/doctor/abs_mean"] == pytest.approx(
        experiences[0].info["mismatch/logp_abs_diff_mean"][0].item(), rel=1e-5
    )
    assert got["mismatch/logp_abs_diff_max"] > 0  # aligned train vs unaligned "engine" differ

    # OpenRLHF's replay path: split per sample, regroup at random, and its per-sample mean
    # (what PolicyModelActor.ppo_train all-reduces and logs as train/<key>) is the step's statistic.
    items = [item for exp in experiences for item in split_experience_batch(exp)]
    random.Random(0).shuffle(items)
    for chunk in (items[:1], items[1:4]):
        regrouped = make_experience_batch(chunk)
        for key, want in expected.items():
            values = torch.tensor(regrouped.info[key], dtype=torch.float)
            assert values.mean().item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_no_rollout_log_probs_warns_and_keeps_going(plugin_ray, rollout, plugin_log):
    from rlalign_verl.openrlhf.setup import add_step_metrics

    samples, _ = rollout
    bare = [type(s)(**{**s.__dict__, "rollout_log_probs": None, "info": dict(s.info)}) for s in samples]
    for s in bare:
        s.action_log_probs = torch.zeros_like(s.action_mask, dtype=torch.float)
    assert add_step_metrics(bare, None) is None
    assert not any(k.startswith("mismatch/") for s in bare for k in s.info)
    assert any("--alignment.collect_rollout_logprobs true" in m for m in plugin_log)


def test_metric_failure_warns_never_raises(plugin_ray, openrlhf_args, rollout, plugin_log):
    from rlalign_verl.openrlhf.setup import add_step_metrics

    samples, _ = rollout
    broken = [type(s)(**{**s.__dict__, "info": dict(s.info)}) for s in samples]
    for s in broken:
        s.action_log_probs = torch.zeros(1, 2)  # wrong width
    assert add_step_metrics(broken, openrlhf_args) is None
    assert any(m.startswith("mismatch metrics skipped (MetricsInputError") for m in plugin_log)


def test_a_step_of_only_nan_log_probs_is_said_as_on_verl(plugin_ray, openrlhf_args, rollout, plugin_log):
    from rlalign_verl.openrlhf.setup import add_step_metrics

    samples, _ = rollout
    nan = [type(s)(**{**s.__dict__, "info": dict(s.info)}) for s in samples]
    for s in nan:
        s.action_log_probs = torch.zeros_like(s.action_mask, dtype=torch.float)
        s.rollout_log_probs = torch.full_like(s.action_log_probs, float("nan"))
    metrics = add_step_metrics(nan, openrlhf_args)
    assert metrics["mismatch/num_tokens"] == 0 and metrics["mismatch/nonfinite_tokens"] > 0
    said = [m for m in plugin_log if "response tokens of this step have a NaN/inf log-prob" in m]
    assert said and "only the counts are logged" in said[0], plugin_log


def test_measure_only_requests_rollout_log_probs(plugin_ray, openrlhf_args):
    """With --alignment.collect_rollout_logprobs and IS correction off, OpenRLHF's samples generator sends
    logprobs=1 to the engines; with the option off it sends what OpenRLHF would (None)."""
    import ray
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.utils import get_strategy
    from rlalign_openrlhf_testkit import EngineDouble

    assert openrlhf_args.algo.advantage.is_correction_level == "off"
    engine = EngineDouble.remote()
    generator = SamplesGenerator(get_strategy(openrlhf_args), None, None, None, [engine])
    ray.get(generator._dispatch_prompts_to_vllm(["a"], [""], max_new_tokens=4))
    with plugin_settings(Settings.build(regions=(), metrics=True, collect_rollout_logprobs=False)):
        ray.get(generator._dispatch_prompts_to_vllm(["b"], [""], max_new_tokens=4))
    assert ray.get(engine.recorded.remote()) == [
        {"prompt": "a", "logprobs": 1},
        {"prompt": "b", "logprobs": None},
    ]
    ray.kill(engine)


def test_measure_only_asks_vllm_for_processed_log_probs(plugin_ray):
    import openrlhf.trainer.ray as ray_pkg
    from openrlhf.trainer.ray import vllm_engine

    from rlalign_verl.openrlhf.setup import engines_with_logprobs_mode

    assert getattr(ray_pkg.create_vllm_engines, "_rlalign_wrapped", False)  # what train_ppo_ray imports
    assert ray_pkg.create_vllm_engines is vllm_engine.create_vllm_engines
    seen = []

    def record(*args, **kwargs):
        seen.append(inspect.signature(record).bind(*args, **kwargs).arguments["logprobs_mode"])

    record.__signature__ = inspect.signature(vllm_engine.create_vllm_engines.__wrapped__)
    wrapped = engines_with_logprobs_mode(record)
    # the call in openrlhf/cli/train_ppo_ray.py passes logprobs_mode as the 12th positional argument
    wrapped(1, 1, "m", 0, False, False, True, 64, None, 0.9, False, None, agent_func_path=None)
    wrapped(1, 1, "m", 0, False, False, True, 64, None, 0.9, False, "processed_logprobs")
    assert seen == ["processed_logprobs", "processed_logprobs"]


def test_measure_only_leaves_the_loss_unchanged():
    """OpenRLHF's PolicyLoss with IS correction off ignores rollout log-probs: collecting them for the
    metrics changes nothing in training."""
    from openrlhf.models import PolicyLoss

    g = torch.Generator().manual_seed(0)
    logp, old, rollout, adv = (torch.randn(3, 7, generator=g) * 0.1 - 1 for _ in range(4))
    mask = torch.ones(3, 7)
    mask[2, 5:] = 0
    loss_fn = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, is_correction_level="off")
    without = loss_fn(logp, old, adv, action_mask=mask)
    with_rollout = loss_fn(logp, old, adv, action_mask=mask, rollout_log_probs=rollout)
    assert torch.equal(without[0], with_rollout[0])
    assert with_rollout[3] is None  # no vllm_kl: the IS-correction branch did not run
    corrected = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, is_correction_level="token")(
        logp, old, adv, action_mask=mask, rollout_log_probs=rollout
    )
    assert not torch.equal(corrected[0], without[0])  # the comparison above can fail


def _without_verification(settings):
    off = {"enable": False, "skip_unverified_engine": True}
    return type(settings)(settings.spec.replace(verify=off), settings.collect_rollout_logprobs)


def test_verify_pass_on_real_actors(plugin_ray, openrlhf_args, policy_group, rollout, tiny_qwen2, plugin_log):
    """The verify step's unaligned pass runs in the real model actor with alignment switched off: against this
    test's "engine" (the unaligned HF model) it matches, so alignment is measurably worse here; on_worse=stop
    stops the step, on_worse=warn logs mismatch/verify/* on every experience; the actor is aligned afterwards."""
    import ray
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
    from openrlhf.utils import get_strategy
    from transformers import AutoTokenizer

    from rlalign_verl.measure.verify import VerifyFailedError

    samples, _ = rollout
    maker = RemoteExperienceMaker(policy_group, None, None, None, FixedKLController(0.0),
                                  get_strategy(openrlhf_args), AutoTokenizer.from_pretrained(str(tiny_qwen2)))  # fmt: skip
    with (
        plugin_settings(plugin_ray),
        pytest.raises(VerifyFailedError, match="--alignment.verify.on_worse warn"),
    ):
        maker.make_experience_batch([s for s in samples])
    warn = type(plugin_ray)(plugin_ray.spec.replace(verify={"on_worse": "warn", "ladder": True}), True)
    with plugin_settings(warn):
        experiences = maker.make_experience_batch([s for s in samples])
    info = experiences[0].info
    # unaligned = the "engine" up to the fp32 log-softmax of another code path (1e-7), aligned ~0.1 away
    assert (
        info["mismatch/verify/unaligned"][0].item() < 1e-6 < 1e-3 < info["mismatch/verify/aligned"][0].item()
    )
    assert info["mismatch/verify/verdict"][0].item() == -1.0
    assert info["mismatch/verify/ladder/none"][0].item() < 1e-6
    assert all("mismatch/verify/verdict" in e.info for e in experiences)
    assert any("verify step 1" in m and "WORSE" in m for m in plugin_log)
    assert ray.get(policy_group._actor_handlers[0].alignment.remote())[0] == ("rope", "swiglu", "rmsnorm")
