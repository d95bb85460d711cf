"""What the verl driver checks before Ray starts, the launcher checks too: the checkpoint of
``--actor.model_name_or_path`` (older ``--pretrain``), its architecture against the regions, the dtypes and
``--vllm.tensor_parallel_size`` read as OpenRLHF's parser reads it. Each refusal: exit 2, one line naming the
flag, Ray never started. Checkpoints are folders holding only ``config.json`` (all the launcher reads)."""

from __future__ import annotations

import pytest

pytest.importorskip("openrlhf")

from rlalign_verl.openrlhf import flags  # noqa: E402
from rlalign_verl.openrlhf.settings import parse_launcher_args  # noqa: E402
from rlalign_verl.openrlhf.train_ppo_ray import main  # noqa: E402

QWEN2 = {"model_type": "qwen2"}
NOWHERE = "/nonexistent-rlalign-test/model"
EMPTY = "<an existing folder without config.json>"
OLD_RELEASE = {"--pretrain", "--vllm_num_engines", "--vllm_tensor_parallel_size", "--enforce_eager"}

# id -> (checkpoint: config.json fields, raw config.json text, NOWHERE, EMPTY or None (no flag), regions,
#        extra argv, error type, fragment of the one line ({path}: the checkpoint folder))
BAD = {
    "gpt2": ({"model_type": "gpt2"}, "rope", [], "UnsupportedModelError",
             "--actor.model_name_or_path {path}: model type 'gpt2' is not supported"),
    "mistral": ({"model_type": "mistral"}, "rope", [], "UnsupportedModelError",
                "--actor.model_name_or_path {path}: model type 'mistral' is not supported"),
    "folder does not exist": (NOWHERE, "rope,moe", [], "AlignmentError",
                              f"--actor.model_name_or_path {NOWHERE} does not exist on the launcher's machine"),
    "folder without config.json": (EMPTY, "rope", [], "AlignmentError",
                                   "--actor.model_name_or_path {path} holds no config.json"),
    "config.json not JSON": ('{"model_type": "qwen2",', "rope", [], "ConfigFormatError",
                             "is not valid JSON (Expecting property name"),
    "config.json a list": ("[1, 2]", "rope", [], "ConfigFormatError", "holds a JSON list, not an object"),
    "config.json without model_type": ('{"hidden_size": 8}', "rope", [], "AlignmentError",
                                       "(--actor.model_name_or_path) names no model_type (None)"),
    "no model flag": (None, "rope", [], "AlignmentError", "--actor.model_name_or_path is not set"),
    "moe on a dense model": (QWEN2, "rope,moe", [], "UnsupportedModelError",
                             "{path}: the moe region aligns MoE routers"),
    "gelu mlp with swiglu": ({**QWEN2, "hidden_act": "gelu"}, "swiglu", [], "UnsupportedModelError",
                             "hidden_act='gelu': the swiglu region computes silu only"),
    "sigmoid router": ({"model_type": "qwen3_moe", "scoring_func": "sigmoid"}, "rope", [], "UnsupportedModelError",
                       "qwen3_moe: scoring_func='sigmoid' is not supported"),
    "fp32 engine head": ({**QWEN2, "head_dtype": "float32"}, "rope", [], "AlignmentError",
                         "head_dtype='float32' in the config.json of --actor.model_name_or_path: OpenRLHF's vLLM"),
    "unknown head dtype": ({**QWEN2, "head_dtype": "fp8"}, "rope", [], "HeadDtypeError", "is not a head dtype"),
    "fp16 trainer": (QWEN2, "rope", ["--ds.param_dtype", "fp16"], "UnsupportedModelError",
                     "use --ds.param_dtype bf16"),
    "tp 0": (QWEN2, "rope,tp", ["--vllm.tensor_parallel_size", "0"], "ConfigFormatError",
             "--vllm.tensor_parallel_size '0' is not a tensor-parallel size OpenRLHF runs"),
    "tp 2.0": (QWEN2, "rope,tp", ["--vllm.tensor_parallel_size=2.0"], "ConfigFormatError",
               "--vllm.tensor_parallel_size '2.0' is not"),
    "tp -2": (QWEN2, "rope,tp", ["--vllm.tensor_parallel_size", "-2"], "ConfigFormatError", "integer >= 1"),
    "tp two": (QWEN2, "rope,tp", ["--vllm.tensor_parallel_size", "two"], "ConfigFormatError", "integer >= 1"),
    "tp abbreviated": (QWEN2, "rope,tp", ["--vllm.tensor_parallel", "2"], "ConfigFormatError",
                       "--vllm.tensor_parallel abbreviates --vllm.tensor_parallel_size"),
}  # fmt: skip


def _checkpoint(tmp_path, config_dir, checkpoint) -> list[str]:
    """The model flag for one row's checkpoint."""
    if checkpoint is None:
        return []
    if isinstance(checkpoint, dict):
        return ["--actor.model_name_or_path", config_dir(**checkpoint)]
    if checkpoint == NOWHERE:
        return ["--actor.model_name_or_path", NOWHERE]
    if checkpoint != EMPTY:
        (tmp_path / "config.json").write_text(checkpoint, encoding="utf-8")
    return ["--actor.model_name_or_path", str(tmp_path)]


def _refused(argv: list[str], capsys, monkeypatch) -> str:
    """The one error line of ``main(argv)`` (exit 2, Ray never started)."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started despite a bad setting"))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("case", list(BAD))
def test_what_the_verl_driver_refuses_the_launcher_refuses_before_ray(
    case, tmp_path, config_dir, capsys, monkeypatch
):
    checkpoint, regions, extra, error, fragment = BAD[case]
    model = _checkpoint(tmp_path, config_dir, checkpoint)
    line = _refused(
        ["--alignment.regions", regions, *model, *extra, "--vllm.num_engines", "1"], capsys, monkeypatch
    )
    path = model[1] if model else ""
    assert line.startswith(f"[rlalign-verl] ERROR {error}: "), line
    assert fragment.format(path=path) in line, line


@pytest.mark.parametrize(
    "checkpoint, extra, fragment",
    [
        ({"model_type": "gpt2"}, [], "--pretrain {path}: model type 'gpt2' is not supported"),
        (NOWHERE, [], f"--pretrain {NOWHERE} does not exist"),
        (QWEN2, ["--vllm_tensor_parallel_size", "0"], "--vllm_tensor_parallel_size '0' is not"),
    ],
)
def test_older_release_spellings_are_checked_too(
    checkpoint, extra, fragment, config_dir, capsys, monkeypatch
):
    monkeypatch.setattr(flags, "installed_flags", lambda *a: OLD_RELEASE)
    path = config_dir(**checkpoint) if isinstance(checkpoint, dict) else checkpoint
    argv = ["--alignment.regions", "rope,tp", "--pretrain", path, *extra, "--vllm_num_engines", "1"]
    assert fragment.format(path=path) in _refused(argv, capsys, monkeypatch)


def test_the_rollout_tp_size_is_read_as_openrlhfs_parser_reads_it(qwen2_dir):
    """``type=int``, the last occurrence wins; without the flag OpenRLHF's default 1."""
    model = ["--alignment.regions", "rope,tp", "--actor.model_name_or_path", qwen2_dir]
    for extra, tp in [
        (["--vllm.tensor_parallel_size", "2"], 2),
        (["--vllm.tensor_parallel_size=+4"], 4),
        (["--vllm.tensor_parallel_size", "8", "--vllm.tensor_parallel_size", "2"], 2),
    ]:
        assert parse_launcher_args([*model, *extra]).settings.spec.rollout_tp == tp, extra
    plain = parse_launcher_args(["--alignment.regions", "rope", "--actor.model_name_or_path", qwen2_dir])
    assert plain.settings.spec.rollout_tp == 1


def test_good_checkpoints_and_unaligned_runs_pass(config_dir, plugin_log):
    """Supported local checkpoints (a bf16 engine head), a hub id the launcher cannot read (a warning: the
    workers check), and, with no region on, nothing is read."""
    ok = {
        "qwen2, model head": config_dir("qwen2", head_dtype="model"),
        "llama, bf16 trainer": config_dir("llama"),
        "hub id": "rlalign-test/not-cached-anywhere",
    }
    for case, path in ok.items():
        argv = ["--alignment.regions", "rope", "--actor.model_name_or_path", path, "--ds.param_dtype", "bf16"]
        assert parse_launcher_args(argv).settings.regions == ("rope",), case
    assert any("cannot read the model config of rlalign-test/not-cached-anywhere" in m for m in plugin_log)
    unaligned = [
        "--alignment.regions",
        "none",
        "--actor.model_name_or_path",
        NOWHERE,
        "--ds.param_dtype",
        "fp16",
    ]
    assert parse_launcher_args([*unaligned, "--vllm.tensor_parallel_size", "0"]).settings.regions == ()
