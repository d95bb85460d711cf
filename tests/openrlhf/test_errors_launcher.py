"""Bad launcher input: one row per argv -> exit code 2, the error type and a fragment of its one line,
printed before Ray starts; OpenRLHF's flags read under the spelling of the installed release."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("openrlhf")

from rlalign_verl.openrlhf import flags  # noqa: E402
from rlalign_verl.openrlhf.settings import parse_launcher_args  # noqa: E402
from rlalign_verl.openrlhf.train_ppo_ray import main  # noqa: E402


@pytest.fixture
def base(qwen2_dir) -> list[str]:
    """OpenRLHF flags of a launch that passes every check: a local Qwen2 checkpoint, one vLLM engine."""
    return ["--actor.model_name_or_path", qwen2_dir, "--vllm.num_engines", "1"]


# id -> (argv, error type, fragment of the one error line)
BAD = {
    "engine sglang": (["--alignment.regions", "all", "--alignment.engine", "sglang"], "ProfileMismatchError",
                      "OpenRLHF samples with vLLM"),
    "engine hf": (["--alignment.regions", "rope", "--alignment.engine", "hf"], "ProfileMismatchError",
                  "--alignment.engine auto"),
    "eager profile, compiled vLLM": (["--alignment.regions", "rope", "--alignment.engine", "vllm-eager"],
                                     "ProfileMismatchError", "add --vllm.enforce_eager"),
    "compiled profile, eager vLLM": (["--alignment.regions", "rope", "--alignment.engine", "vllm-cpu",
                                      "--vllm.enforce_eager"], "ProfileMismatchError", "drop --vllm.enforce_eager"),
    "engine typo": (["--alignment.regions", "rope", "--alignment.engine", "trtllm"], "UnknownProfileError",
                    "valid profiles"),
    "region typo": (["--alignment.regions", "rope,gelu"], "UnknownRegionError", "valid regions"),
    "metrics=maybe": (["--alignment.metrics", "maybe"], "ConfigFormatError", "--alignment.metrics=false"),
    "collect=2": (["--alignment.collect_rollout_logprobs", "2"], "ConfigFormatError",
                  "--alignment.collect_rollout_logprobs=true"),
    "unknown plugin flag": (["--alignment.region", "rope"], "ConfigFormatError",
                            "unknown alignment key --alignment.region; did you mean --alignment.regions?"),
    "missing value": (["--alignment.regions"], "AlignmentError", "--alignment.regions needs a value"),
    "old spelling": (["--alignment.regions", "rmsnorm", "--alignment.compiled_norm"], "ConfigFormatError",
                     "--alignment.compiled_norm moved to --alignment.experimental.compiled_norm"),
    "verify.every=-1": (["--alignment.verify.every", "-1"], "ConfigFormatError", "--alignment.verify.every=-1"),
    "flat --enforce_eager": (["--alignment.regions", "rope", "--enforce_eager"], "ConfigFormatError",
                             "use --vllm.enforce_eager"),
    "flat --enable_vllm_is_correction": (["--enable_vllm_is_correction"], "ConfigFormatError",
                                         "use --algo.advantage.is_correction_level"),
    "flat --vllm_is_truncated_threshold": (["--vllm_is_truncated_threshold=2"], "ConfigFormatError",
                                           "use --algo.advantage.is_correction_threshold"),
    "flat --use_liger_kernel": (["--alignment.regions", "rope", "--use_liger_kernel"], "ConfigFormatError",
                                "use --ds.use_liger_kernel"),
    "compiled_norm on a CUDA profile": (["--alignment.regions", "rmsnorm", "--alignment.experimental.compiled_norm"],
                                        "AlignmentError", "turn it off"),
    "compiled_norm without rmsnorm": (["--alignment.regions", "rope", "--alignment.engine", "vllm-cpu",
                                       "--alignment.experimental.compiled_norm=true"], "AlignmentError", "add rmsnorm"),
    "head dtype without lm_head": (["--alignment.regions", "rope", "--alignment.engine", "vllm-cpu",
                                    "--alignment.experimental.head_dtype", "model"], "AlignmentError",
                                   "--alignment.experimental.head_dtype model sets what the lm_head region computes"),
    "tp alone at TP 1": (["--alignment.regions", "tp", "--alignment.engine", "vllm-cpu"], "AlignmentError",
                         "(--alignment.regions) change nothing at rollout tensor parallel 1"),
    "compiled_norm=maybe": (["--alignment.experimental.compiled_norm", "maybe"], "ConfigFormatError",
                            "--alignment.experimental.compiled_norm=false"),
    "liger with alignment": (["--alignment.regions", "rope", "--ds.use_liger_kernel"], "LigerConflictError",
                             "drop --ds.use_liger_kernel"),
    "top-p fed into the IS correction": (["--rollout.top_p", "0.8", "--algo.advantage.is_correction_level", "token"],
                                         "DoctorConfigError", "or acknowledge it: --alignment.doctor.allow top_p_top_k"),
    "doctor.allow typo": (["--alignment.doctor.allow", "top_p"], "ConfigFormatError", "top_p_top_k"),
    "flat --top_p": (["--top_p", "0.9"], "ConfigFormatError", "use --rollout.top_p"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_launcher_input_is_one_line_and_exit_2(case, base, capsys, monkeypatch):
    argv, error, fragment = BAD[case]
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started despite a bad setting"))
    with pytest.raises(SystemExit) as info:
        main([*argv, *base])
    assert info.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"[rlalign-verl] ERROR {error}: ") and fragment in lines[0], lines[0]


def test_python_m_launcher_exits_2_with_one_line_and_no_traceback(base):
    result = subprocess.run(
        [sys.executable, "-m", "rlalign_verl.openrlhf.train_ppo_ray", "--alignment.engine", "sglang",
         "--alignment.regions", "all", *base],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Ray initialised" not in result.stderr
    assert [ln for ln in result.stderr.splitlines() if ln.startswith("[rlalign-verl] ERROR")] == [
        "[rlalign-verl] ERROR ProfileMismatchError: --alignment.engine sglang mirrors sglang, but OpenRLHF samples "
        "with vLLM; use --alignment.engine auto (or vllm, vllm-eager)"
    ]


# --- both generations of OpenRLHF's flags --------------------------------------------------------------

OLD_RELEASE = {"--enforce_eager", "--use_liger_kernel", "--enable_vllm_is_correction",
               "--vllm_is_truncated_threshold", "--vllm_num_engines", "--eps_clip", "--pretrain"}  # fmt: skip
NEW_RELEASE = flags.installed_flags()

# id -> (flags the installed release declares, extra argv, profile chosen / error fragment)
SPELLINGS = {
    "new release, dotted eager": (NEW_RELEASE, ["--vllm.enforce_eager"], "vllm-eager"),
    "new release, no eager": (NEW_RELEASE, [], "vllm"),
    "old release, flat eager": (OLD_RELEASE, ["--enforce_eager"], "vllm-eager"),
    "old release, flat eager=false refused": (OLD_RELEASE, ["--enforce_eager=false"], "is an on/off switch"),
    "new release, eager=false refused": (NEW_RELEASE, ["--vllm.enforce_eager=false"], "is an on/off switch"),
    "new release, eager false refused": (
        NEW_RELEASE,
        ["--vllm.enforce_eager", "false"],
        "is an on/off switch",
    ),
    "new release, liger=true refused": (NEW_RELEASE, ["--ds.use_liger_kernel=true"], "is an on/off switch"),
    "new release, other switch=1 refused": (NEW_RELEASE, ["--ckpt.save_hf=1"], "is an on/off switch"),
    "old release, dotted eager refused": (OLD_RELEASE, ["--vllm.enforce_eager"], "use --enforce_eager"),
    "old release, dotted liger refused": (OLD_RELEASE, ["--ds.use_liger_kernel"], "use --use_liger_kernel"),
}


@pytest.mark.parametrize("case", list(SPELLINGS))
def test_flags_are_read_in_the_installed_release_spelling(case, qwen2_dir, monkeypatch):
    known, extra, want = SPELLINGS[case]
    assert NEW_RELEASE and "--vllm.enforce_eager" in NEW_RELEASE  # the test env has OpenRLHF >= 0.10
    monkeypatch.setattr(flags, "installed_flags", lambda *a: known)
    if known is OLD_RELEASE:  # the old release's on/off switches (store_true, as in the new one)
        monkeypatch.setattr(flags, "installed_switches", lambda *a: {"--enforce_eager", "--use_liger_kernel"})
    model = "--pretrain" if known is OLD_RELEASE else "--actor.model_name_or_path"
    argv = ["--alignment.regions", "rope", model, qwen2_dir, *extra]
    if not want.startswith("vllm"):
        with pytest.raises(Exception, match=want):
            parse_launcher_args(argv)
    else:
        assert parse_launcher_args(argv).settings.profile == want


def test_old_release_liger_and_is_correction_spellings_are_read(qwen2_dir, monkeypatch):
    from rlalign_verl.base.errors import LigerConflictError
    from rlalign_verl.openrlhf.settings import rollout_logprobs_requested

    monkeypatch.setattr(flags, "installed_flags", lambda *a: OLD_RELEASE)
    with pytest.raises(LigerConflictError):
        parse_launcher_args(["--alignment.regions", "rope", "--use_liger_kernel", "--pretrain", qwen2_dir])
    assert rollout_logprobs_requested(["--enable_vllm_is_correction"])
    assert rollout_logprobs_requested(["--algo.advantage.is_correction_level", "token"])
    assert not rollout_logprobs_requested(["--algo.advantage.is_correction_level", "off"])


def test_acknowledged_confounders_are_warnings_and_the_launch_goes_on(base, monkeypatch, plugin_log):
    import ray

    class Started(Exception):
        pass

    def init(*args, **kwargs):
        raise Started

    monkeypatch.setattr(ray, "init", init)
    argv = ["--rollout.top_p", "0.8", "--algo.advantage.is_correction_level", "token", "--train.async_enable",
            "--alignment.doctor.allow", "top_p_top_k"]  # fmt: skip
    with pytest.raises(Started):
        main([*argv, *base])
    lines = [m for m in plugin_log if m.startswith("doctor: ")]
    assert len(lines) == 2 and "(acknowledged in --alignment.doctor.allow)" in lines[0], lines
    assert lines[1].startswith("doctor: --train.async_enable:")
    plugin_log.clear()
    with pytest.raises(Started):  # the doctor off: no check, no error
        main([*argv[:5], "--alignment.doctor.enable", "false", *base])
    assert not any(m.startswith("doctor: ") for m in plugin_log)
