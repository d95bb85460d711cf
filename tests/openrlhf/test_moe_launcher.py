"""MoE parallel settings the alignment cannot follow: the launcher refuses them with one line, before Ray.

OpenRLHF 0.11.2 has no expert-parallel flag (its vLLM engines get fixed arguments); a flag naming it is
refused for MoE checkpoints, and vLLM tensor parallel (experts split over ranks, bf16 all-reduce) is refused
with the moe region. Dense models, remote models and settings without the MoE regions pass.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openrlhf")

from rlalign_verl.openrlhf import flags  # noqa: E402
from rlalign_verl.openrlhf.settings import Settings, parse_launcher_args  # noqa: E402
from rlalign_verl.openrlhf.train_ppo_ray import main  # noqa: E402


def _model(tmp_path, model_type: str) -> str:
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(d)


# id -> (regions, extra argv, fragment of the one error line)
BAD = {
    "expert parallel flag": ("all", ["--vllm.enable_expert_parallel"], "expert parallel (--vllm.enable_expert_parallel)"),
    "expert parallel size=": ("swiglu", ["--vllm.expert_parallel_size=2"], "expert parallel sums"),
    "vllm tp 2 with moe": ("all,moe", ["--vllm.tensor_parallel_size", "2"], "add tp to the regions"),
    "vllm tp=4 with moe only": ("moe", ["--vllm.tensor_parallel_size=4"], "(or drop moe)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_moe_parallel_settings_are_refused_before_ray(case, tmp_path, capsys, monkeypatch):
    regions, extra, fragment = BAD[case]
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started despite a bad setting"))
    monkeypatch.setattr(flags, "installed_flags", lambda *a: None)  # the EP flags are not OpenRLHF 0.11.2's
    argv = [
        "--alignment.regions",
        regions,
        "--actor.model_name_or_path",
        _model(tmp_path, "qwen3_moe"),
        *extra,
    ]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--vllm.num_engines", "1"])
    assert info.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("[rlalign-verl] ERROR AlignmentError: ") and fragment in lines[0], lines[0]
    assert "qwen3_moe" in lines[0] and ("expert parallel" in lines[0] or "splits each expert" in lines[0])


# id -> (model type or a remote name, regions, extra argv)
GOOD = {
    "tp 2 without moe": ("qwen3_moe", "all", ["--vllm.tensor_parallel_size", "2"]),
    "tp 1 with moe": ("qwen2_moe", "all,moe", ["--vllm.tensor_parallel_size=1"]),
    "dense model, tp 2": ("qwen2", "all", ["--vllm.tensor_parallel_size", "2"]),
    "nothing aligned, expert parallel": ("qwen3_moe", "none", ["--vllm.enable_expert_parallel"]),
    "remote model": (None, "all,moe", ["--vllm.tensor_parallel_size", "2"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GOOD))
def test_supported_settings_pass(case, tmp_path, monkeypatch):
    model_type, regions, extra = GOOD[case]
    monkeypatch.setattr(flags, "installed_flags", lambda *a: None)
    path = _model(tmp_path, model_type) if model_type else "Qwen/Qwen3-30B-A3B"
    # the default vllm profile's MoE data is unverified (a dense model refuses the opt-in: it would use nothing)
    # (and with no region on, a setting that acts only on aligned regions is refused)
    opted = (
        ["--alignment.experimental.unverified", "moe"] if model_type != "qwen2" and regions != "none" else []
    )
    opts = parse_launcher_args(
        ["--alignment.regions", regions, *opted, "--actor.model_name_or_path", path, *extra]
    )
    assert opts.openrlhf_argv[-len(extra) :] == extra


def test_openrlhf_declares_no_expert_parallel_flag():
    """What the module docstring claims about the installed release (re-check on an OpenRLHF upgrade)."""
    installed = flags.installed_flags()
    assert installed and "--vllm.tensor_parallel_size" in installed
    assert not [f for f in installed if "expert_parallel" in f]


def test_unverified_moe_data_needs_the_opt_in_before_ray(tmp_path, capsys, monkeypatch):
    """vllm's MoE rounding is read from source (verified=False): refused before Ray without
    the opt-in; with it the launcher passes and forwards the opt-in to every Ray worker."""
    import ray

    from rlalign_verl.openrlhf.train_ppo_ray import runtime_env

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started despite a bad setting"))
    argv = ["--alignment.regions", "all", "--actor.model_name_or_path", _model(tmp_path, "qwen3_moe")]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--vllm.num_engines", "1"])
    assert info.value.code == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert (
        "UNVERIFIED" in line
        and "--alignment.experimental.unverified moe" in line
        and "gpu_moe_check.py" in line
    )
    assert parse_launcher_args(["--alignment.regions", "rope,rmsnorm", *argv[2:]])  # dense regions: no opt-in
    assert parse_launcher_args([*argv, "--alignment.engine", "vllm-cpu"])  # verified CPU data: no opt-in
    opts = parse_launcher_args([*argv, "--alignment.experimental.unverified", "moe"])
    carried = Settings.from_env(runtime_env(opts.settings)["env_vars"])
    assert carried.spec.experimental.unverified == ("moe",)


def test_compiled_norm_flag_on_moe_checkpoints(tmp_path):
    """--alignment.experimental.compiled_norm is verified on MoE models too: carried for MoE and dense checkpoints."""
    argv = [
        "--alignment.regions",
        "rope,rmsnorm",
        "--alignment.engine",
        "vllm-cpu",
        "--alignment.experimental.compiled_norm",
    ]
    for kind in ("qwen2", "qwen3_moe", "qwen2_moe"):
        ok = parse_launcher_args([*argv, "--actor.model_name_or_path", _model(tmp_path, kind)])
        assert ok.settings.spec.experimental.compiled_norm is True


def test_moe_variant_flag(tmp_path):
    """--alignment.moe_variant engine-op: carried to every Ray worker's apply_alignment; refused by the launcher,
    one line each, with a CUDA profile, without swiglu or moe, on a dense checkpoint, for an unknown name."""
    from rlalign_verl.base.errors import AlignmentError
    from rlalign_verl.openrlhf.train_ppo_ray import runtime_env

    moe, dense = _model(tmp_path, "qwen3_moe"), _model(tmp_path, "qwen2")
    argv = [
        "--alignment.regions",
        "all,moe",
        "--alignment.engine",
        "vllm-cpu",
        "--alignment.experimental.moe_variant",
        "engine-op",
    ]
    opts = parse_launcher_args([*argv, "--actor.model_name_or_path", moe])
    env = runtime_env(opts.settings)["env_vars"]
    assert Settings.from_env(env).spec.experimental.moe_variant == "engine-op"
    assert "moe_variant=engine-op" in opts.settings.describe()
    plain = parse_launcher_args(
        [
            "--alignment.regions",
            "all,moe",
            "--alignment.engine",
            "vllm-cpu",
            "--actor.model_name_or_path",
            moe,
        ]
    )
    assert plain.settings.spec.experimental.moe_variant == "emulate"
    bad = {
        "cuda profile": (
            ["--alignment.engine", "auto", "--alignment.experimental.unverified", "moe"],
            moe,
            "vllm-cpu profiles",
        ),
        "no moe region": (["--alignment.regions", "rope,swiglu"], moe, "add moe"),
        "dense model": ([], dense, "needs an MoE model"),
        "unknown": (["--alignment.experimental.moe_variant", "fused"], moe, "use one of"),
    }
    for case, (extra, model, fragment) in bad.items():
        with pytest.raises(AlignmentError) as e:
            parse_launcher_args([*argv, *extra, "--actor.model_name_or_path", model])
        assert "\n" not in str(e.value) and fragment in str(e.value), (case, str(e.value))


@pytest.mark.parametrize(
    "regions, extra, fragment",
    [
        ("all,moe", ["--alignment.experimental.unverified", "moe"], "it would align nothing"),
        ("all", ["--alignment.experimental.unverified", "moe"], "never uses"),
    ],
)
def test_moe_settings_on_a_dense_model_are_refused(regions, extra, fragment, tmp_path, monkeypatch):
    """A region or opt-in that wraps nothing on the model is refused in one line, not logged as aligned."""
    from rlalign_verl.base.errors import AlignmentError

    monkeypatch.setattr(flags, "installed_flags", lambda *a: None)
    argv = ["--alignment.regions", regions, *extra, "--actor.model_name_or_path", _model(tmp_path, "qwen2")]
    with pytest.raises(AlignmentError, match=fragment):
        parse_launcher_args([*argv, "--vllm.tensor_parallel_size", "2"])


def test_the_rollout_tp_size_comes_from_openrlhfs_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(flags, "installed_flags", lambda *a: None)
    model = ["--actor.model_name_or_path", _model(tmp_path, "qwen2")]
    opts = parse_launcher_args(["--alignment.regions", "all,tp", *model, "--vllm.tensor_parallel_size", "2"])
    assert opts.settings.spec.rollout_tp == 2 and "tp" in opts.settings.spec.regions
    assert parse_launcher_args(["--alignment.regions", "rope", *model]).settings.spec.rollout_tp == 1


def test_a_hand_set_rollout_tp_flag_is_refused(tmp_path, monkeypatch):
    from rlalign_verl.base.errors import ConfigFormatError

    monkeypatch.setattr(flags, "installed_flags", lambda *a: None)
    argv = [
        "--alignment.regions",
        "tp",
        "--alignment.rollout_tp",
        "2",
        "--actor.model_name_or_path",
        _model(tmp_path, "qwen2"),
    ]
    with pytest.raises(
        ConfigFormatError, match="--alignment.rollout_tp is set by the driver .*--vllm.tensor_parallel_size"
    ):
        parse_launcher_args(argv)
