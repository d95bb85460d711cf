"""The launcher: flag parsing and validation, the Ray runtime env, and the hook reaching real workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("openrlhf")

from rlalign_verl.base.errors import (  # noqa: E402
    AlignmentError,
    LigerConflictError,
    UnknownProfileError,
    UnknownRegionError,
)
from rlalign_verl.openrlhf.settings import Settings, parse_launcher_args  # noqa: E402
from rlalign_verl.openrlhf.setup import HOOK  # noqa: E402
from rlalign_verl.openrlhf.train_ppo_ray import runtime_env  # noqa: E402


@pytest.fixture
def openrlhf_flags(qwen2_dir) -> list[str]:
    """OpenRLHF's own flags of a launch: a local Qwen2 checkpoint (config.json only) and a few others."""
    return [
        "--actor.model_name_or_path",
        qwen2_dir,
        "--vllm.num_engines",
        "1",
        "--rollout.batch_size",
        "8",
        "--data.input_template",
        "{}",
    ]


def test_plugin_flags_are_stripped_and_openrlhf_flags_kept_in_order(openrlhf_flags):
    argv = [
        "--alignment.regions",
        "rope,swiglu",
        openrlhf_flags[0],
        openrlhf_flags[1],
        "--alignment.metrics=false",
        *openrlhf_flags[2:],
        "--alignment.collect_rollout_logprobs",
        "--address",
        "10.0.0.1:6379",
    ]
    opts = parse_launcher_args(argv)
    assert opts.openrlhf_argv == openrlhf_flags
    assert opts.settings == Settings.build(
        regions=("rope", "swiglu"), profile="vllm", metrics=False, collect_rollout_logprobs=True, auto=True
    )
    assert opts.address == "10.0.0.1:6379"


def test_defaults_measure_nothing_aligned(openrlhf_flags):
    opts = parse_launcher_args(openrlhf_flags)
    assert opts.settings == Settings.build(
        regions=(), profile="vllm", metrics=True, collect_rollout_logprobs=False, auto=True
    )
    assert opts.address is None


@pytest.mark.parametrize(
    ("extra", "engine", "profile", "auto"),
    [
        ([], "vllm", "vllm", False),
        (["--vllm.enforce_eager"], "vllm", "vllm-eager", False),
        (["--enforce_eager"], "auto", "vllm-eager", True),  # older flat flag name
        ([], "AUTO", "vllm", True),
        (["--vllm.enforce_eager"], "vllm-cpu-eager", "vllm-cpu-eager", False),  # an explicit profile is kept
        ([], "vllm-cpu", "vllm-cpu", False),
    ],
)
def test_profile_follows_openrlhf_enforce_eager_unless_given(
    extra, engine, profile, auto, openrlhf_flags, monkeypatch
):
    monkeypatch.setattr(
        "rlalign_verl.openrlhf.flags.installed_flags", lambda *a: None
    )  # any OpenRLHF release
    opts = parse_launcher_args(
        ["--alignment.regions", "all", "--alignment.engine", engine, *extra, *openrlhf_flags]
    )
    assert opts.settings.profile == profile
    assert opts.settings.auto is auto  # only auto lets the workers move the profile to their device
    assert opts.settings.regions == ("rope", "swiglu", "rmsnorm")
    assert opts.openrlhf_argv == [*extra, *openrlhf_flags]


def test_bad_input_gives_errors_that_name_the_fix(openrlhf_flags, monkeypatch):
    monkeypatch.setattr(
        "rlalign_verl.openrlhf.flags.installed_flags", lambda *a: None
    )  # any OpenRLHF release
    with pytest.raises(UnknownRegionError, match=r"valid regions: \['rope', 'swiglu', 'rmsnorm'"):
        parse_launcher_args(["--alignment.regions", "rope,gelu", *openrlhf_flags])
    with pytest.raises(UnknownProfileError, match="valid profiles: vllm, vllm-eager"):
        parse_launcher_args(["--alignment.regions", "rope", "--alignment.engine", "trtllm"])
    with pytest.raises(AlignmentError, match="unknown alignment key --alignment.region; did you mean"):
        parse_launcher_args(["--alignment.region", "rope", *openrlhf_flags])
    with pytest.raises(
        AlignmentError, match="not a boolean; use --alignment.metrics=true or --alignment.metrics=false"
    ):
        parse_launcher_args(["--alignment.metrics", "maybe"])
    for liger in ("--ds.use_liger_kernel", "--use_liger_kernel"):
        with pytest.raises(LigerConflictError, match="drop --ds.use_liger_kernel"):
            parse_launcher_args(["--alignment.regions", "rmsnorm", liger, *openrlhf_flags])
    # Liger without alignment is the user's business (metrics only)
    assert parse_launcher_args(["--ds.use_liger_kernel"]).settings.regions == ()


def test_settings_travel_in_one_env_var():
    s = Settings.build(
        regions=("swiglu", "rope"), profile="vllm-eager", metrics=False, collect_rollout_logprobs=True
    )
    env = s.to_env()
    assert list(env) == ["RLALIGN_OPENRLHF"]  # the workers read only this: no other spelling overrides it
    assert Settings.from_env(env) == s
    assert Settings.from_env({**env, "RLALIGN_UNVERIFIED": "moe", "RLALIGN_TRITON": "1"}) == s
    assert Settings.from_env({}) is None
    opted = Settings.build(regions="rope", profile="vllm-cpu", compiled_norm=True, unverified="moe")
    back = Settings.from_env(opted.to_env())
    assert (
        back == opted
        and "compiled_norm=True" in back.describe()
        and back.spec.experimental.unverified == ("moe",)
    )
    with pytest.raises(AlignmentError):
        Settings.from_env({"RLALIGN_OPENRLHF": '{"spec": {"regions": "rope,bogus"}}'})


def test_runtime_env_has_openrlhf_env_vars_settings_and_hook(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", raising=False)
    s = Settings.build(regions=("rope",), profile="vllm")
    env = runtime_env(s)
    assert env["worker_process_setup_hook"] == HOOK == "rlalign_verl.openrlhf.setup.install"
    assert env["env_vars"]["NCCL_DEBUG"] == "INFO"  # a user-set value wins, as in OpenRLHF's train()
    assert env["env_vars"]["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "1"
    assert "TOKENIZERS_PARALLELISM" in env["env_vars"]
    assert Settings.from_env(env["env_vars"]) == s


def test_hook_installs_plugin_in_real_ray_workers(plugin_ray, ray_cluster):
    import ray
    import rlalign_openrlhf_testkit as kit

    # connected to the existing cluster through RAY_ADDRESS, not a new local one
    assert ray.get_runtime_context().gcs_address == ray_cluster
    expected = (plugin_ray.regions, plugin_ray.profile, True, True, True)

    driver = kit.plugin_state()
    assert driver["settings"] == expected and driver["actor_wrapped"] and driver["experience_maker_wrapped"]

    worker = ray.get(kit.remote_plugin_state.remote())
    assert worker["pid"] != os.getpid()
    assert worker["settings"] == expected
    assert worker["actor_wrapped"] and worker["experience_maker_wrapped"]
    assert Settings.from_env(worker["env"]).regions == ("rope", "swiglu", "rmsnorm")

    actor = kit.CpuModelActor.options(num_cpus=0).remote(1, 0, None, None)
    state = ray.get(actor.state.remote())
    assert state["pid"] not in (os.getpid(), worker["pid"]) and state["settings"] == expected
    assert state["actor_wrapped"]
    ray.kill(actor)


def _launch(args, **env):
    return subprocess.run(
        [sys.executable, "-m", "rlalign_verl.openrlhf.train_ppo_ray", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_launcher_help_shows_both_flag_sets():
    result = _launch(["--alignment.regions", "rope", "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--alignment.collect_rollout_logprobs" in result.stdout  # ours
    assert "--vllm.enforce_eager" in result.stdout and "--ds.use_liger_kernel" in result.stdout  # OpenRLHF's


def test_launcher_runs_openrlhf_main_after_ray_init(ray_cluster, qwen2_dir):
    """Up to OpenRLHF's own argument validation (training itself needs GPUs): our flags are gone, Ray
    is initialised against the cluster with the hook, and OpenRLHF's parser accepts the rest."""
    args = [
        "--alignment.regions",
        "rope,swiglu",
        "--alignment.engine",
        "vllm",
        "--vllm.enforce_eager",
        "--actor.model_name_or_path",
        qwen2_dir,
        "--algo.advantage.estimator",
        "group_norm",
        "--rollout.n_samples_per_prompt",
        "1",
    ]
    result = _launch(args, RAY_ADDRESS=ray_cluster)
    assert result.returncode != 0
    err = result.stderr
    assert "regions=['rope', 'swiglu'] profile=vllm-eager" in err
    assert f"Ray initialised (address {ray_cluster}) with worker_process_setup_hook={HOOK}" in err
    assert "group_norm requires n_samples_per_prompt > 1" in err  # OpenRLHF's own check ran
    assert "unrecognized arguments" not in err


def test_launcher_rejects_bad_input_before_ray_starts():
    result = _launch(["--alignment.regions", "rope,softmax"])
    assert result.returncode != 0
    assert "UnknownRegionError" in result.stderr and "valid regions" in result.stderr
    assert "Ray initialised" not in result.stderr


_LAZY_INSTALL = """
import sys
from rlalign_verl.openrlhf.setup import install
install()
print(sorted(m for m in ("openrlhf", "deepspeed", "transformers", "torch") if m in sys.modules))
import openrlhf.trainer.ray as pkg
from openrlhf.models import Actor
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils import samples_generator
print(Actor.__init__._rlalign_wrapped, RemoteExperienceMaker.make_experience_batch._rlalign_wrapped,
      samples_generator.SamplingParams(temperature=1.0).logprobs, pkg.create_vllm_engines._rlalign_wrapped)
"""


def test_install_is_import_light_and_patches_modules_when_imported():
    """The setup hook runs in every worker (vLLM engines too): it imports nothing heavy itself; each
    patch lands when OpenRLHF imports the module."""
    env = Settings.build(regions=("rope",), metrics=True, collect_rollout_logprobs=True).to_env()
    result = subprocess.run(
        [sys.executable, "-c", _LAZY_INSTALL],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "[]"
    assert lines[-1] == "True True 1 True"


def test_compiled_norm_flag_reaches_the_worker_settings(qwen2_dir):
    """--alignment.experimental.compiled_norm with the compiled CPU profile: parsed, carried, off by default."""
    argv = [
        "--actor.model_name_or_path",
        qwen2_dir,
        "--alignment.regions",
        "all",
        "--alignment.engine",
        "vllm-cpu",
        "--alignment.experimental.compiled_norm",
    ]
    on = parse_launcher_args(argv).settings
    assert on.spec.experimental.compiled_norm is True
    assert Settings.from_env(on.to_env()) == on
    assert parse_launcher_args(argv[:6]).settings.spec.experimental.compiled_norm is False
    assert parse_launcher_args([*argv, "false"]).settings.spec.experimental.compiled_norm is False
