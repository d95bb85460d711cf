"""The ``alignment`` config group on verl's real ``ppo_trainer`` config, and driver-side validation."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from hydra import compose, initialize_config_module  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl_configs import ENTRY_DRIVER, GRPO_MINIMAL, cases, run_driver  # noqa: E402

from rlalign_verl.errors import (  # noqa: E402
    AlignmentError,
    LigerConflictError,
    ProfileMismatchError,
    UnknownProfileError,
    UnknownRegionError,
    UnsupportedModelError,
)
from rlalign_verl.verl.config import (  # noqa: E402
    choose_profile,
    resolve_alignment_config,
    validate_config,
)

pytestmark = pytest.mark.verl

REGION_CASES = [
    ("[rope]", ["rope"]),
    ("[rope,swiglu,rmsnorm]", ["rope", "swiglu", "rmsnorm"]),
    ("[]", []),
]


def compose_ours(*overrides: str):
    """Our primary config (verl's ppo_trainer + alignment group), as rlalign_verl.main_ppo composes it."""
    with initialize_config_module(config_module="rlalign_verl.configs", version_base=None):
        return compose("rlalign_ppo_trainer", overrides=list(overrides))


def compose_verl(*overrides: str):
    """verl's own ppo_trainer with our group added through hydra.searchpath, as verl's main_ppo does."""
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(
            "ppo_trainer",
            overrides=["hydra.searchpath=[pkg://rlalign_verl.configs]", "+alignment=default", *overrides],
        )


def _resolved(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.fixture
def qwen2_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen2"))


@pytest.mark.parametrize("composer", [compose_ours, compose_verl], ids=["ours", "verl"])
@pytest.mark.parametrize("regions_arg,expected", REGION_CASES, ids=["rope", "all", "none"])
def test_compose_reaches_actor_not_critic(composer, regions_arg, expected):
    cfg = _resolved(composer(f"alignment.regions={regions_arg}", "actor_rollout_ref.rollout.name=vllm"))
    assert cfg["alignment"] == {
        "regions": expected,
        "engine": "auto",
        "metrics": True,
        "compile": False,
        "kernels": "torch",
        "attention": "engine-op",
        "head_dtype": "float32",
        "unverified": [],
        "compiled_norm": False,
    }
    override = cfg["actor_rollout_ref"]["model"]["override_config"]
    assert override == {"rlalign_regions": expected, "rlalign_engine": "auto"}
    assert cfg["critic"]["model"]["override_config"] == {}
    # verl's own keys are untouched by our group
    assert cfg["actor_rollout_ref"]["actor"]["strategy"] == "fsdp"
    assert cfg["algorithm"]["adv_estimator"] == "gae"


def test_compose_group_choices():
    assert _resolved(compose_ours("alignment=rope"))["alignment"]["regions"] == ["rope"]
    cfg = _resolved(compose_ours("alignment=all", "alignment.engine=sglang"))
    assert cfg["alignment"]["regions"] == ["rope", "swiglu", "rmsnorm"]
    assert cfg["actor_rollout_ref"]["model"]["override_config"]["rlalign_engine"] == "sglang"
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(
            "ppo_trainer", overrides=["hydra.searchpath=[pkg://rlalign_verl.configs]", "+alignment=all"]
        )
    assert _resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]["rlalign_regions"] == [
        "rope",
        "swiglu",
        "rmsnorm",
    ]


def test_verl_config_without_group_rejects_alignment_key():
    """What the group fixes: on verl's bare config the key is not in struct."""
    from hydra.errors import ConfigCompositionException

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        with pytest.raises(ConfigCompositionException):
            compose("ppo_trainer", overrides=["alignment.regions=[rope]"])


_CFG_JOB_DRIVER = """
import runpy, sys
for i, argv in enumerate({runs!r}):
    sys.argv = [argv[0] + ".py", *argv[1:], "--cfg", "job", "--resolve"]
    print(f"=== run {{i}} ===", flush=True)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    sys.stdout.flush()
"""


def _cfg_job_runs(runs: list[list[str]]) -> list[dict]:
    """``python -m <module> <args> --cfg job --resolve`` for each run, all in one fresh subprocess
    (``runpy.run_module(..., run_name="__main__")`` is what ``python -m`` does)."""
    import yaml

    out = run_driver(_CFG_JOB_DRIVER, runs)
    chunks = out.stdout.split("=== run ")[1:]
    assert len(chunks) == len(runs), out.stdout[-2000:]
    return [yaml.safe_load(chunk.split("\n", 1)[1]) for chunk in chunks]


def test_cfg_job_subprocess():
    """``--cfg job`` of both entry points (ours and verl's + our group) for each region setting."""
    runs, expected = [], []
    for regions_arg, want in REGION_CASES:
        common = [f"alignment.regions={regions_arg}", "actor_rollout_ref.rollout.name=vllm"]
        runs.append(["rlalign_verl.main_ppo", *common])
        runs.append(
            [
                "verl.trainer.main_ppo",
                "hydra.searchpath=[pkg://rlalign_verl.configs]",
                "+alignment=default",
                *common,
            ]
        )
        expected += [want, want]
    for cfg, want in zip(_cfg_job_runs(runs), expected, strict=True):
        assert cfg["alignment"] == {
            "regions": want,
            "engine": "auto",
            "metrics": True,
            "compile": False,
            "kernels": "torch",
            "attention": "engine-op",
            "head_dtype": "float32",
            "unverified": [],
            "compiled_norm": False,
        }
        assert cfg["actor_rollout_ref"]["model"]["override_config"] == {
            "rlalign_regions": want,
            "rlalign_engine": "auto",
        }
        assert cfg["critic"]["model"]["override_config"] == {}
        assert cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm"
        assert cfg["algorithm"]["adv_estimator"] == "gae"


# --- automatic profile choice -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(rollout_name="vllm", on_cuda=True), "vllm"),
        (dict(rollout_name="vllm", enforce_eager=True, on_cuda=True), "vllm-eager"),
        (dict(rollout_name="vllm", on_cuda=False), "vllm-cpu"),
        (dict(rollout_name="vllm", enforce_eager=True, on_cuda=False), "vllm-cpu-eager"),
        (dict(rollout_name="sglang", on_cuda=True), "sglang"),
        (dict(rollout_name="vllm", compilation_config={"custom_ops": ["all"]}, on_cuda=True), "vllm-eager"),
        (dict(rollout_name="vllm", compilation_config={"custom_ops": ["none"]}, on_cuda=True), "vllm"),
        (
            dict(
                rollout_name="vllm",
                compilation_config='{"custom_ops": ["+rms_norm", "+silu_and_mul", "+rotary_embedding"]}',
                on_cuda=True,
            ),
            "vllm-eager",
        ),
        (dict(rollout_name="vllm", compilation_config={"mode": 0}, on_cuda=True), "vllm-eager"),
        (
            dict(
                rollout_name="vllm",
                compilation_config={"custom_ops": ["all", "-rms_norm", "-silu_and_mul", "-rotary_embedding"]},
                on_cuda=True,
            ),
            "vllm",
        ),
    ],
)
def test_choose_profile(kwargs, expected):
    name, reason = choose_profile(**kwargs)
    assert name == expected
    assert "vllm" in reason or "sglang" in reason


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rollout_name=None),
        dict(rollout_name="trtllm"),
        dict(rollout_name="vllm", compilation_config={"custom_ops": ["+rms_norm"]}),
    ],
)
def test_choose_profile_errors(kwargs):
    with pytest.raises(ProfileMismatchError, match="alignment.engine"):
        choose_profile(**kwargs)


def test_resolve_from_config_auto_and_explicit():
    cfg = compose_ours(
        "alignment.regions=[rope]",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enforce_eager=true",
    )
    regions, profile, reason = resolve_alignment_config(cfg, on_cuda=True)
    assert (regions, profile) == (("rope",), "vllm-eager")
    assert "enforce_eager=True" in reason
    cfg = compose_ours(
        "alignment.regions=[rope]",
        "actor_rollout_ref.rollout.name=vllm",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config={custom_ops:[all]}",
    )
    assert resolve_alignment_config(cfg, on_cuda=False)[1] == "vllm-cpu-eager"
    cfg = compose_ours("alignment.regions=[swiglu]", "actor_rollout_ref.rollout.name=sglang")
    assert resolve_alignment_config(cfg, on_cuda=True)[:2] == (("swiglu",), "sglang")
    cfg = compose_ours(
        "alignment.regions=[rmsnorm]", "alignment.engine=vllm-eager", "actor_rollout_ref.rollout.name=vllm"
    )
    assert resolve_alignment_config(cfg, on_cuda=False)[1] == "vllm-eager"
    vllm = "actor_rollout_ref.rollout.name=vllm"
    assert resolve_alignment_config(compose_ours(vllm), on_cuda=True) == (
        (),
        None,
        "alignment.regions is empty: alignment off (profile would be vllm)",
    )
    # a baseline run still names the profile the workers would use (not "auto")
    assert resolve_alignment_config(compose_ours(vllm), on_cuda=False)[2].endswith(
        "(profile would be vllm-cpu)"
    )


# --- validation ----------------------------------------------------------------------------------


def _valid(qwen2_path: str, *extra: str):
    return compose_ours(
        "alignment.regions=[rope,swiglu]",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.model.path={qwen2_path}",
        *extra,
    )


def test_validate_writes_resolved_settings_for_workers(qwen2_path):
    cfg = _valid(qwen2_path)
    assert validate_config(cfg, on_cuda=False) == (("rope", "swiglu"), "vllm-cpu")
    override = _resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]
    assert override == {
        "rlalign_regions": ["rope", "swiglu"],
        "rlalign_engine": "vllm-cpu",
        "rlalign_engine_auto": True,
        "rlalign_rollout": "vllm",
    }
    assert _resolved(cfg)["critic"]["model"]["override_config"] == {}


def test_validate_passes_compile_to_workers_only_when_on(qwen2_path):
    cfg = _valid(qwen2_path, "alignment.compile=true")
    validate_config(cfg, on_cuda=False)
    override = _resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]
    assert override == {"rlalign_regions": ["rope", "swiglu"], "rlalign_engine": "vllm-cpu", "rlalign_compile": True,
                        "rlalign_engine_auto": True, "rlalign_rollout": "vllm"}  # fmt: skip
    cfg = compose_ours(f"actor_rollout_ref.model.path={qwen2_path}", "actor_rollout_ref.rollout.name=vllm",
                       "alignment.compile=true")  # fmt: skip
    validate_config(cfg, on_cuda=False)
    assert "rlalign_compile" not in _resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]


def test_validate_off_sends_nothing_to_workers(qwen2_path):
    cfg = compose_ours(f"actor_rollout_ref.model.path={qwen2_path}", "actor_rollout_ref.rollout.name=vllm")
    assert validate_config(cfg, on_cuda=False) == ((), None)
    # an explicit [] (not a missing key) also overrides a stale value in a checkpoint's config.json
    assert _resolved(cfg)["actor_rollout_ref"]["model"]["override_config"] == {"rlalign_regions": []}


def test_validate_keeps_user_override_config(qwen2_path):
    cfg = _valid(qwen2_path, "+actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    validate_config(cfg, on_cuda=True)
    override = _resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]
    assert override == {
        "attn_implementation": "sdpa",
        "rlalign_regions": ["rope", "swiglu"],
        "rlalign_engine": "vllm",
        "rlalign_engine_auto": True,
        "rlalign_rollout": "vllm",
    }


def test_error_unknown_region(qwen2_path):
    with pytest.raises(UnknownRegionError, match=r"alignment.regions=\[rope\]"):
        validate_config(_valid(qwen2_path, "alignment.regions=[rope,gelu]"), on_cuda=True)


def test_error_unknown_engine(qwen2_path):
    with pytest.raises(UnknownProfileError, match="alignment.engine"):
        validate_config(_valid(qwen2_path, "alignment.engine=tensorrt"), on_cuda=True)


def test_error_liger(qwen2_path):
    with pytest.raises(LigerConflictError, match="use_liger=False"):
        validate_config(_valid(qwen2_path, "actor_rollout_ref.model.use_liger=true"), on_cuda=True)


def test_liger_without_alignment_is_fine(qwen2_path):
    cfg = _valid(qwen2_path, "actor_rollout_ref.model.use_liger=true", "alignment.regions=[]")
    assert validate_config(cfg, on_cuda=True) == ((), None)


def test_error_unsupported_model(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    cfg = compose_ours(
        "alignment.regions=[rope]",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.model.path={tmp_path}",
    )
    with pytest.raises(UnsupportedModelError, match="alignment.regions=\\[\\]"):
        validate_config(cfg, on_cuda=True)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_validate_accepts_moe_and_rejects_expert_parallel(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    args = ("alignment.regions=[rope,swiglu]", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={tmp_path}")  # fmt: skip
    assert validate_config(compose_ours(*args), on_cuda=False) == (("rope", "swiglu"), "vllm-cpu")
    with pytest.raises(AlignmentError, match=r"expert_parallel_size=4: .*expert_parallel_size=1") as err:
        validate_config(
            compose_ours(*args, "actor_rollout_ref.rollout.expert_parallel_size=4"), on_cuda=False
        )
    assert "\n" not in str(err.value)


def test_validate_refuses_unverified_cuda_moe_data_without_the_opt_in(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    args = ("alignment.regions=[rope,swiglu]", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={tmp_path}")  # fmt: skip
    monkeypatch.delenv("RLALIGN_UNVERIFIED", raising=False)
    with pytest.raises(UnsupportedModelError, match="RLALIGN_UNVERIFIED=moe") as err:
        validate_config(compose_ours(*args), on_cuda=True)  # the vllm profile on CUDA
    assert "\n" not in str(err.value) and "gpu_moe_check.py" in str(err.value)
    monkeypatch.setenv("RLALIGN_UNVERIFIED", "moe")
    assert validate_config(compose_ours(*args), on_cuda=True) == (("rope", "swiglu"), "vllm")


def test_error_profile_contradicts_rollout(qwen2_path):
    with pytest.raises(ProfileMismatchError, match="rollout.name=sglang"):
        validate_config(
            _valid(qwen2_path, "alignment.engine=vllm", "actor_rollout_ref.rollout.name=sglang"), on_cuda=True
        )
    with pytest.raises(ProfileMismatchError, match="rollout.name=vllm"):
        validate_config(_valid(qwen2_path, "alignment.engine=sglang"), on_cuda=True)


def test_error_metrics_without_rollout_log_probs(qwen2_path):
    cfg = _valid(qwen2_path, "actor_rollout_ref.rollout.calculate_log_probs=false")
    with pytest.raises(AlignmentError, match="calculate_log_probs=True"):
        validate_config(cfg, on_cuda=True)
    cfg = _valid(qwen2_path, "actor_rollout_ref.rollout.calculate_log_probs=false", "alignment.metrics=false")
    assert validate_config(cfg, on_cuda=True) == (("rope", "swiglu"), "vllm")


@pytest.mark.parametrize("policy", ["none", "some_other_plugin"])
def test_error_plugin_disabled_for_workers(qwen2_path, monkeypatch, policy):
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", policy)
    with pytest.raises(AlignmentError, match="add rlalign_verl to the list"):
        validate_config(_valid(qwen2_path), on_cuda=True)
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "some_other_plugin,rlalign_verl")
    assert validate_config(_valid(qwen2_path), on_cuda=True)[0] == ("rope", "swiglu")


def test_error_non_fsdp_strategy(qwen2_path):
    with pytest.raises(AlignmentError, match="fsdp or fsdp2"):
        validate_config(_valid(qwen2_path, "actor_rollout_ref.actor.strategy=megatron"), on_cuda=True)


def test_error_rollout_name_missing_with_auto(qwen2_path):
    cfg = compose_ours("alignment.regions=[rope]", f"actor_rollout_ref.model.path={qwen2_path}")
    with pytest.raises(ProfileMismatchError, match="actor_rollout_ref.rollout.name"):
        validate_config(cfg, on_cuda=True)


def test_verl_validate_config_runs_ours(qwen2_path):
    """verl's own validate_config (what verl's main_ppo calls) raises our error once the plugin is loaded."""
    import verl.utils.config as verl_config

    import rlalign_verl.verl.plugin  # noqa: F401  (loaded by `import verl` already)

    cfg = _valid(qwen2_path, "actor_rollout_ref.model.use_liger=true")
    with pytest.raises(LigerConflictError):
        verl_config.validate_config(cfg, use_reference_policy=False, use_critic=False)


def test_entry_points_validate_on_driver_before_ray(qwen2_path):
    """Both entry points run our validation before run_ppo; a bad setting stops the run there."""
    good = [
        "alignment.regions=[rope]",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enforce_eager=true",
        f"actor_rollout_ref.model.path={qwen2_path}",
        *GRPO_MINIMAL,
    ]
    bad = [*good, "actor_rollout_ref.model.use_liger=true"]
    verl_entry = [
        "verl.trainer.main_ppo",
        "hydra.searchpath=[pkg://rlalign_verl.configs]",
        "+alignment=default",
    ]
    runs = [
        ["rlalign_verl.main_ppo", *good],
        [*verl_entry, *good],
        ["rlalign_verl.main_ppo", *bad],
        [*verl_entry, *bad],
    ]
    out = run_driver(ENTRY_DRIVER, runs, HYDRA_FULL_ERROR="1")
    sections = cases(out.stdout)
    assert len(sections) == 4, out.stdout[-3000:]
    profile = "vllm-eager" if _cuda() else "vllm-cpu-eager"
    for section in sections[:2]:
        line = next(ln for ln in section.splitlines() if ln.startswith("REACHED_RUN_PPO "))
        assert json.loads(line.split(" ", 1)[1]) == {
            "rlalign_regions": ["rope"], "rlalign_engine": profile, "rlalign_engine_auto": True, "rlalign_rollout": "vllm"
        }  # fmt: skip
    for section in sections[2:]:
        assert "REACHED_RUN_PPO" not in section, section
        assert "RAISED LigerConflictError actor_rollout_ref.model.use_liger=True" in section, section
    assert f"alignment regions=rope profile={profile}" in out.stderr


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_validate_passes_triton_kernels_only_when_asked(qwen2_path):
    cfg = _valid(qwen2_path, "alignment.kernels=triton")
    validate_config(cfg, on_cuda=False)
    assert _resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]["rlalign_kernels"] == "triton"
    cfg = _valid(qwen2_path)  # default: torch, nothing sent (the workers' default is the PyTorch path)
    validate_config(cfg, on_cuda=False)
    assert "rlalign_kernels" not in _resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]


@pytest.mark.parametrize(
    "extra, match",
    [
        (("alignment.kernels=cuda",), "use torch"),
        (("alignment.kernels=triton", "alignment.compile=true"), "choose one"),
    ],
)
def test_error_bad_kernels(qwen2_path, extra, match):
    with pytest.raises(AlignmentError, match=match):
        validate_config(_valid(qwen2_path, *extra), on_cuda=False)


def test_error_hook_target_moved(qwen2_path, monkeypatch):
    from rlalign_verl.verl import model_hook

    monkeypatch.setattr(model_hook, "ENGINE_MODULE", "verl.workers.engine.fsdp.moved_away")
    with pytest.raises(AlignmentError, match=r"install verl==0\.9\.1"):
        validate_config(_valid(qwen2_path), on_cuda=False)


def test_baseline_banner_names_the_resolved_profile(monkeypatch):
    """regions=[]: the trainer's start-up line names the profile the workers would use, never `auto`."""
    from rlalign_verl.verl import trainer_callback
    from rlalign_verl.verl.config import would_use_profile

    lines = []
    monkeypatch.setattr(trainer_callback.logger, "info", lambda msg, *a: lines.append(msg % a))
    monkeypatch.setattr("rlalign_verl.verl.config.cuda_available", lambda: False)
    trainer_callback._start_run(compose_ours("actor_rollout_ref.rollout.name=vllm"))
    assert lines == ["alignment regions=none (baseline) profile=vllm-cpu; mismatch metrics (mismatch/*) on"]
    eager = compose_ours(
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=True"
    )
    assert would_use_profile(eager, on_cuda=True) == "vllm-eager"
    unresolved = would_use_profile(compose_ours("actor_rollout_ref.rollout.name=trtllm"), on_cuda=False)
    assert unresolved.startswith("auto (unresolved: ") and "alignment.engine" in unresolved


def test_error_hf_profile_with_a_real_rollout_engine(qwen2_path):
    with pytest.raises(ProfileMismatchError, match="not the vllm rollout engine"):
        validate_config(_valid(qwen2_path, "alignment.engine=hf"), on_cuda=True)
