"""Bad verl-side inputs: one row per input -> exception type and a fragment of the one-line fix.

Driver validation (``rlalign_verl.verl.config.validate_config``) on verl's real composed config, and
both entry points as a user runs them: one ``[rlalign-verl] ERROR`` line, exit code 2, no traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from hydra import compose, initialize_config_module  # noqa: E402
from omegaconf import OmegaConf, open_dict  # noqa: E402
from verl_configs import ENTRY_DRIVER, GRPO_MINIMAL, cases, run_driver  # noqa: E402

from rlalign_verl.base.errors import (  # noqa: E402
    AlignmentError,
    ConfigFormatError,
    LigerConflictError,
    ProfileMismatchError,
    UnknownProfileError,
    UnknownRegionError,
    UnsupportedModelError,
    one_line,
)
from rlalign_verl.verl.config import validate_config  # noqa: E402

pytestmark = pytest.mark.verl

SEARCHPATH = "hydra.searchpath=[pkg://rlalign_verl.configs]"
CC = "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A checkpoint directory as the driver reads it: only config.json's model_type matters there."""
    path = tmp_path_factory.mktemp("ckpt") / "qwen2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_act": "silu"}))
    return path


def _ours(*overrides: str):
    with initialize_config_module(config_module="rlalign_verl.configs", version_base=None):
        return compose("rlalign_ppo_trainer", overrides=list(overrides))


def _verl_bare(*overrides: str):
    """verl's own ppo_trainer, as verl's entry point composes it *without* our search path."""
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def _set(cfg, key: str, value) -> None:
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)


# id -> (overrides, {dotted key: value set after composing}, model config.json text or None,
#        expected exception type, fragment of the message)
BAD = {
    "alignment group string (no search path)": (None, {}, None, ConfigFormatError, SEARCHPATH),
    "regions=5": (["alignment.regions=5"], {}, None, ConfigFormatError, "alignment.regions=5: give a list"),
    "regions mapping": (
        [],
        {"alignment.regions": {"a": 1}},
        None,
        ConfigFormatError,
        "not a list of region names",
    ),
    "regions typo": (["alignment.regions=[rope,swigl]"], {}, None, UnknownRegionError, "valid regions"),
    "unknown engine": (["alignment.engine=tensorrt"], {}, None, UnknownProfileError, "valid profiles"),
    "old top-level key": (
        ["+alignment.compile=true"],
        {},
        None,
        ConfigFormatError,
        "alignment.compile moved to alignment.experimental.compile",
    ),
    "key typo +alignment.compiled": (
        ["+alignment.compiled=true"],
        {},
        None,
        ConfigFormatError,
        "did you mean alignment.experimental.compile?",
    ),
    "unknown key": (
        ["+alignment.speed=fast"],
        {},
        None,
        ConfigFormatError,
        "valid: alignment.regions, alignment.engine, alignment.metrics, alignment.verify",
    ),
    "metrics=maybe": (["alignment.metrics=maybe"], {}, None, ConfigFormatError, "alignment.metrics=false"),
    "metrics=2": (["alignment.metrics=2"], {}, None, ConfigFormatError, "alignment.metrics=true"),
    "compile=maybe": (
        ["alignment.experimental.compile=maybe"],
        {},
        None,
        ConfigFormatError,
        "alignment.experimental.compile=false",
    ),
    "quantiles=sometimes": (
        ["alignment.experimental.metrics_quantiles=sometimes"],
        {},
        None,
        ConfigFormatError,
        "alignment.experimental.metrics_quantiles=",
    ),
    "verify.every=-1": (
        ["alignment.verify.every=-1"],
        {},
        None,
        ConfigFormatError,
        "alignment.verify.every=-1",
    ),
    "kernels=cuda": (
        ["alignment.experimental.kernels=cuda"],
        {},
        None,
        ConfigFormatError,
        "use one of torch, triton",
    ),
    "enforce_eager=perhaps": (
        ["actor_rollout_ref.rollout.enforce_eager=perhaps"],
        {},
        None,
        ConfigFormatError,
        "enforce_eager=true",
    ),
    "use_liger='yes' is on": (
        ["actor_rollout_ref.model.use_liger=yes"],
        {},
        None,
        LigerConflictError,
        "use_liger=False",
    ),
    "profile contradicts the rollout": (
        ["alignment.engine=sglang"],
        {},
        None,
        ProfileMismatchError,
        "rollout engine is vllm",
    ),
    "hf profile with a real rollout": (
        ["alignment.engine=hf"],
        {},
        None,
        ProfileMismatchError,
        "changes nothing",
    ),
    "rollout name missing with auto": (
        [],
        {"actor_rollout_ref.rollout.name": None},
        None,
        ProfileMismatchError,
        "actor_rollout_ref.rollout.name",
    ),
    "metrics without rollout log-probs": (
        ["actor_rollout_ref.rollout.calculate_log_probs=false"],
        {},
        None,
        AlignmentError,
        "calculate_log_probs=True",
    ),
    "non-FSDP strategy": (
        ["actor_rollout_ref.actor.strategy=megatron"],
        {},
        None,
        AlignmentError,
        "fsdp or fsdp2",
    ),
    "unsupported architecture": ([], {}, '{"model_type": "gpt2"}', UnsupportedModelError, "not supported"),
    "compilation_config malformed JSON": ([], {CC: '{"mode": 0'}, None, ConfigFormatError, "not valid JSON"),
    "compilation_config a list": ([], {CC: [1, 2]}, None, ConfigFormatError, "not a JSON object"),
    "compilation_config JSON list": ([], {CC: "[0]"}, None, ConfigFormatError, "not a JSON object"),
    "custom_ops a string": (
        [],
        {CC: {"custom_ops": "all"}},
        None,
        ConfigFormatError,
        "custom_ops='all' is not a list",
    ),
    "config.json truncated": ([], {}, '{"model_type": "qw', ConfigFormatError, "truncated?"),
    "config.json a list": ([], {}, '[{"model_type": "qwen2"}]', ConfigFormatError, "JSON list"),
    "config.json binary": ([], {}, "\udcff\udcfe\x00", ConfigFormatError, "cannot read"),
}


def _build(case: str, model_dir: Path, tmp_path: Path):
    overrides, updates, config_json, _, _ = BAD[case]
    path = str(model_dir)
    if config_json is not None:
        path = tmp_path / "broken"
        path.mkdir()
        (path / "config.json").write_bytes(config_json.encode("utf-8", "surrogateescape"))
    base = [f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.rollout.name=vllm"]
    if overrides is None:
        cfg = _verl_bare("+alignment=all", *base)
    else:
        cfg = _ours("alignment.regions=[rope,swiglu,rmsnorm]", *base, *overrides)
    for key, value in updates.items():
        _set(cfg, key, value)
    return cfg


@pytest.mark.parametrize("case", list(BAD))
def test_bad_verl_input_is_a_one_line_error(case, model_dir, tmp_path):
    *_, exc_type, fragment = BAD[case]
    cfg = _build(case, model_dir, tmp_path)
    with pytest.raises(exc_type) as info:
        validate_config(cfg, on_cuda=False)
    line = one_line(info.value)
    assert fragment in line, line
    assert "\n" not in line and line.startswith(f"[rlalign-verl] ERROR {exc_type.__name__}: ")


# Strict booleans: each spelling -> (mismatch metrics on, compiled regions sent to the workers)
SPELLINGS = {
    "off": False, "'false'": False, "no": False, "0": False, "False": False,
    "on": True, "'true'": True, "yes": True, "1": True, "TRUE": True,
}  # fmt: skip


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_boolean_spellings_are_parsed_strictly(spelling, model_dir):
    want = SPELLINGS[spelling]
    cfg = _ours(
        "alignment.regions=[rope]",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.calculate_log_probs=false",
        f"alignment.metrics={spelling}",
        "alignment.verify.enable=false",
        f"alignment.experimental.compile={spelling}",
    )
    if want:  # metrics on without rollout log-probs: refused, and the fix names a spelling that works
        with pytest.raises(Exception, match=r"alignment\.metrics=false") as info:
            validate_config(cfg, on_cuda=False)
        cfg = _ours(
            "alignment.regions=[rope]",
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={model_dir}",
            "alignment.metrics=false",
            "alignment.verify.enable=false",
            f"alignment.experimental.compile={spelling}",
        )
        assert "calculate_log_probs=True" in str(info.value)
    assert validate_config(cfg, on_cuda=False).experimental.compile is want


# --- entry points as a user runs them --------------------------------------------------------------

# id -> (argv, fragment of the one error line)
ENTRY = {
    "verl entry, +alignment=all without search path": (
        ["verl.trainer.main_ppo", "+alignment=all"],
        SEARCHPATH,
    ),
    "verl entry, liger": (
        ["verl.trainer.main_ppo", SEARCHPATH, "+alignment=all", "actor_rollout_ref.model.use_liger=true"],
        "use_liger=False",
    ),
    "our entry, metrics=maybe": (
        ["rlalign_verl.main_ppo", "alignment=all", "alignment.metrics=maybe"],
        "alignment.metrics",
    ),
    "our entry, regions=5": (["rlalign_verl.main_ppo", "alignment.regions=5"], "alignment.regions=5"),
    "our entry, a moved key": (
        ["rlalign_verl.main_ppo", "alignment=all", "alignment.compile=true"],
        "alignment.compile moved to alignment.experimental.compile",
    ),
}


def test_entry_points_print_one_line_and_exit_2(model_dir):
    runs = [
        [
            *argv,
            *GRPO_MINIMAL,
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={model_dir}",
        ]
        for argv, _ in ENTRY.values()
    ]
    out = run_driver(ENTRY_DRIVER, runs, HYDRA_FULL_ERROR=None)
    stdouts, stderrs = cases(out.stdout), cases(out.stderr)
    assert len(stdouts) == len(stderrs) == len(ENTRY), out.stdout[-2000:] + out.stderr[-2000:]
    for (case, (_, fragment)), so, se in zip(ENTRY.items(), stdouts, stderrs, strict=True):
        assert "REACHED_RUN_PPO" not in so, case
        assert so.strip().splitlines()[-1] == "EXIT 2", (case, so)
        errors = [ln for ln in se.splitlines() if ln.startswith("[rlalign-verl] ERROR")]
        assert len(errors) == 1 and fragment in errors[0], (case, se[-2000:])
        assert "Traceback" not in se and "HYDRA_FULL_ERROR" not in se, (case, se[-2000:])


def test_verl_entry_point_names_a_moved_key_before_hydra():
    """``import verl`` loads the plugin before Hydra composes: an old key is our one line, not "not in struct"."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            SEARCHPATH,
            "+alignment=all",
            "alignment.kernels=triton",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("[rlalign-verl] ERROR")]
    assert errors == [
        "[rlalign-verl] ERROR ConfigFormatError: alignment.kernels moved to alignment.experimental.kernels; "
        "rename it on the command line"
    ]
    assert "Traceback" not in out.stderr
