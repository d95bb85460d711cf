"""Driver-side validation of the ``alignment`` group: the one spec it writes for the workers, and both entry points."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from verl_configs import ENTRY_DRIVER, GRPO_MINIMAL, cases, compose_ours, resolved, run_driver, valid_config  # noqa: E402

from rlalign_verl.base.errors import LigerConflictError, ProfileMismatchError  # noqa: E402
from rlalign_verl.request.spec import AlignmentSpec  # noqa: E402
from rlalign_verl.verl.config import validate_config  # noqa: E402

pytestmark = pytest.mark.verl


def _worker_spec(cfg) -> AlignmentSpec:
    override = resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]
    assert [k for k in override if k.startswith("rlalign")] == ["rlalign_spec"]  # one key carries the request
    return AlignmentSpec.from_json(override["rlalign_spec"])


def test_prefill_decode_disaggregation_gives_the_decode_tp_size(qwen2_path):
    """SGLang PD disaggregation: the decode servers' TP size is the rollout's (every response token but the
    first is decoded there); the tp region, which models one all-reduce size, refuses two sizes."""
    tp_key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    pd = "actor_rollout_ref.rollout.disaggregation"
    on = (f"{pd}.enabled=true", f"{pd}.decode_tensor_model_parallel_size=1", f"{tp_key}=2")
    spec = validate_config(valid_config(qwen2_path, "alignment.regions=[rope]", *on), on_cuda=False)
    assert spec.rollout_tp == 1
    off = (f"{pd}.enabled=false", f"{pd}.decode_tensor_model_parallel_size=1", f"{tp_key}=2")
    assert (
        validate_config(valid_config(qwen2_path, "alignment.regions=[rope]", *off), on_cuda=False).rollout_tp
        == 2
    )
    with pytest.raises(Exception, match="decodes at .*decode_tensor_model_parallel_size=1") as err:
        validate_config(valid_config(qwen2_path, "alignment.regions=[rope,tp]", *on), on_cuda=False)
    assert "\n" not in str(err.value)
    same = (f"{pd}.enabled=true", f"{pd}.decode_tensor_model_parallel_size=2", f"{tp_key}=2")
    assert (
        validate_config(valid_config(qwen2_path, "alignment.regions=[tp]", *same), on_cuda=False).rollout_tp
        == 2
    )


def test_validate_writes_the_resolved_spec_for_workers(qwen2_path):
    cfg = valid_config(qwen2_path, "alignment.experimental.compile=true", "alignment.verify.every=3")
    spec = validate_config(cfg, on_cuda=False)
    assert spec == _worker_spec(cfg)
    assert (spec.regions, spec.engine, spec.engine_auto, spec.rollout) == (
        ("rope", "swiglu"),
        "vllm-cpu",
        True,
        "vllm",
    )
    assert spec.experimental.compile and spec.verify.every == 3
    assert "rlalign_spec" not in resolved(cfg)["critic"]["model"]["override_config"]


def test_the_rollout_tp_size_is_read_from_verl_and_travels_to_the_workers(qwen2_path, caplog):
    """No new verl key: tensor_model_parallel_size is a fact of the rollout, like compiled/eager."""
    tp_key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    cfg = valid_config(qwen2_path, "alignment.regions=[rope,swiglu,rmsnorm,tp]", f"{tp_key}=2")
    spec = validate_config(cfg, on_cuda=False)
    assert spec.rollout_tp == 2 and "tp" in spec.regions and _worker_spec(cfg) == spec
    assert not [r for r in caplog.records if "tp region is off" in r.getMessage()]
    caplog.clear()
    cfg = valid_config(qwen2_path, "alignment.regions=[rope,swiglu,rmsnorm]", f"{tp_key}=2")
    with caplog.at_level("WARNING", logger="rlalign_verl"):
        assert validate_config(cfg, on_cuda=False).rollout_tp == 2
    warned = [r.getMessage() for r in caplog.records if "tp region is off" in r.getMessage()]
    assert len(warned) == 1 and "add tp to alignment.regions" in warned[0], warned
    with pytest.raises(Exception, match="from TP=3 on the ranks hold different") as err:  # vllm-cpu: TP <= 2
        validate_config(valid_config(qwen2_path, "alignment.regions=[tp]", f"{tp_key}=3"), on_cuda=False)
    assert "\n" not in str(err.value)
    with pytest.raises(
        Exception, match="num_attention_heads=4 is not divisible"
    ) as err:  # on the driver, from config.json
        validate_config(
            valid_config(qwen2_path, "alignment.regions=[tp]", "alignment.engine=vllm", f"{tp_key}=8"),
            on_cuda=False,
        )
    with pytest.raises(
        Exception, match=r"regions tp \(alignment.regions\) change nothing at rollout tensor parallel 1"
    ):
        validate_config(valid_config(qwen2_path, "alignment.regions=[tp]", f"{tp_key}=1"), on_cuda=False)
    with pytest.raises(Exception, match="alignment.rollout_tp is set by the driver"):
        validate_config(
            valid_config(qwen2_path, "alignment.regions=[tp]", "+alignment.rollout_tp=2"), on_cuda=False
        )
    with pytest.raises(Exception, match=f"{tp_key}='x'"):
        validate_config(valid_config(qwen2_path, "alignment.regions=[rope]", f"{tp_key}=x"), on_cuda=False)


def test_validate_off_still_writes_an_empty_request(qwen2_path):
    cfg = compose_ours(f"actor_rollout_ref.model.path={qwen2_path}", "actor_rollout_ref.rollout.name=vllm")
    assert validate_config(cfg, on_cuda=False).regions == ()
    # an explicit [] (not a missing key) also overrides a stale value in a checkpoint's config.json
    assert _worker_spec(cfg).regions == ()


def test_validate_keeps_user_override_config(qwen2_path):
    cfg = valid_config(qwen2_path, "+actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    validate_config(cfg, on_cuda=True)
    override = resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]
    assert (
        override["attn_implementation"] == "sdpa"
        and AlignmentSpec.from_json(override["rlalign_spec"]).engine == "vllm"
    )


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_validate_moe_parallelism(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    args = ("alignment.regions=[rope,swiglu,moe]", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1")  # fmt: skip
    assert validate_config(compose_ours(*args), on_cuda=False).engine == "vllm-cpu"
    for extra, fragment in (
        ("actor_rollout_ref.rollout.expert_parallel_size=4", "expert parallel (4)"),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "tensor parallel 2"),
    ):
        with pytest.raises(Exception, match=re.escape(fragment)) as err:
            validate_config(compose_ours(*args, extra), on_cuda=False)
        assert "\n" not in str(err.value)


def test_unverified_moe_data_needs_the_opt_in_and_carries_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    args = ("alignment.regions=[rope,swiglu]", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={tmp_path}")  # fmt: skip
    with pytest.raises(Exception, match=r"alignment.experimental.unverified=\[moe\]") as err:
        validate_config(
            compose_ours(*args), on_cuda=True
        )  # the vllm profile on CUDA: MoE data read from source
    assert "\n" not in str(err.value) and "gpu_moe_check.py" in str(err.value)
    cfg = compose_ours(*args, "alignment.experimental.unverified=[moe]")
    assert validate_config(cfg, on_cuda=True).experimental.unverified == ("moe",)
    assert _worker_spec(cfg).experimental.unverified == ("moe",)


@pytest.mark.parametrize("profile", ["vllm", "vllm-eager", "sglang"])
def test_a_cuda_profile_is_refused_for_cpu_workers(qwen2_path, profile):
    """trainer.device=cpu: the workers run on CPUs, so a CUDA profile is refused at the driver, before Ray starts
    (it used to pass with a warning and fail in the workers)."""
    roll = "sglang" if profile == "sglang" else "vllm"
    cfg = valid_config(qwen2_path, f"alignment.engine={profile}", "trainer.device=cpu",
                       f"actor_rollout_ref.rollout.name={roll}")  # fmt: skip
    with pytest.raises(
        ProfileMismatchError, match=f"profile {profile} mirrors the .* CUDA build .* CPU-only worker"
    ):
        validate_config(cfg, on_cuda=False)
    # auto moves to the CPU build of the same path; an explicit CPU profile passes
    assert validate_config(valid_config(qwen2_path, "trainer.device=cpu"), on_cuda=True).engine == "vllm-cpu"
    assert validate_config(
        valid_config(qwen2_path, "alignment.engine=vllm-cpu", "trainer.device=cpu"), on_cuda=False
    )


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("null", "actor_rollout_ref.model.path is not set"),
        ("''", "actor_rollout_ref.model.path is not set"),
        (
            "'~/models/deepseek-llm-7b-chat'",
            "does not exist on the driver; verl's default path is a placeholder",
        ),
        ("/nonexistent/ckpt", "/nonexistent/ckpt does not exist on the driver"),
        ("/tmp", "/tmp holds no config.json"),
    ],
)
def test_a_missing_model_path_is_refused_before_ray(qwen2_path, path, words):
    """An aligned run needs the checkpoint's model type: an unset or absent local model.path stops the driver."""
    from rlalign_verl.base.errors import AlignmentError

    with pytest.raises(AlignmentError) as info:
        validate_config(valid_config(qwen2_path, f"actor_rollout_ref.model.path={path}"), on_cuda=False)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_cpu_profile_is_refused_on_a_gpu_driver(qwen2_path):
    """The placement is known when the driver sees CUDA: the refusal comes before Ray, not in the workers."""
    with pytest.raises(ProfileMismatchError, match="alignment.engine=vllm"):
        validate_config(valid_config(qwen2_path, "alignment.engine=vllm-cpu"), on_cuda=True)
    assert (
        validate_config(valid_config(qwen2_path, "alignment.engine=vllm-cpu"), on_cuda=False).engine
        == "vllm-cpu"
    )


def test_verl_validate_config_runs_ours(qwen2_path):
    """verl's own validate_config (what verl's main_ppo calls) raises our error once the plugin is loaded."""
    import verl.utils.config as verl_config

    import rlalign_verl.verl.plugin  # noqa: F401  (loaded by `import verl` already)

    cfg = valid_config(qwen2_path, "actor_rollout_ref.model.use_liger=true")
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
        spec = AlignmentSpec.from_json(json.loads(line.split(" ", 1)[1])["rlalign_spec"])
        assert (spec.regions, spec.engine, spec.engine_auto, spec.rollout) == (
            ("rope",),
            profile,
            True,
            "vllm",
        )
    for section in sections[2:]:
        assert "REACHED_RUN_PPO" not in section, section
        assert "RAISED LigerConflictError" in section and "use_liger=False" in section, section
    # the line names the profile the workers use: trainer.device is cuda (verl's default), so on a CPU-only driver
    # auto is chosen as the CPU build here and each worker moves it to its CUDA build
    said = profile if _cuda() else "vllm-eager (the workers run on cuda: auto moves vllm-cpu-eager"
    assert f"alignment regions=rope profile={said}" in out.stderr


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
