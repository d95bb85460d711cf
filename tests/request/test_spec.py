"""One request, one value: every surface builds the same :class:`AlignmentSpec`, every bad input gives the same
one-line error on every surface (named in that surface's spelling), and the value survives its wire format.

Surfaces: ``apply_alignment``'s keywords (``python``), verl's Hydra ``alignment`` node (``hydra``: the node the
driver validates), OpenRLHF's ``--alignment.*`` flags (``flag``: the launcher's parser), and diagnose's settings.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlalign_verl.base.errors import (
    AlignmentError,
    ConfigFormatError,
    ProfileMismatchError,
    UnknownProfileError,
    UnknownRegionError,
    one_line,
)
from rlalign_verl.openrlhf.settings import Settings, parse_launcher_args
from rlalign_verl.request.checks import validate_request
from rlalign_verl.request.spec import AlignmentSpec, DoctorSpec, Experimental, VerifySpec


def _hydra(node: dict) -> AlignmentSpec:
    return AlignmentSpec.parse(OmegaConf.create(node), spelling="hydra")


def _flags(node: dict) -> AlignmentSpec:
    argv: list[str] = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            text = ",".join(value) if isinstance(value, list | tuple) else str(value)
            argv.extend([f"--alignment.{prefix}", text])

    walk("", node)
    # the launcher reads its config.json (MoE: moe is valid)
    checkpoint = Path(tempfile.mkdtemp()) / "qwen3_moe"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "qwen3_moe"}')
    spec = parse_launcher_args([*argv, "--actor.model_name_or_path", str(checkpoint)]).settings.spec
    return spec.replace(
        engine_auto=False, rollout=""
    )  # the launcher resolves these; the table compares the request


def _python(node: dict) -> AlignmentSpec:
    kw = {k: v for k, v in node.items() if k not in ("experimental", "verify", "doctor")}
    kw.update(node.get("experimental", {}))
    for section in ("verify", "doctor"):
        if section in node:
            kw[section] = node[section]
    return AlignmentSpec.parse(spelling="python", **kw)


SURFACES = {"hydra": _hydra, "flag": _flags, "python": _python}

# request (as a nested mapping) -> the spec every surface must build
GOOD = {
    "regions only": (
        {"regions": ["rope"], "engine": "vllm"},
        AlignmentSpec(regions=("rope",), engine="vllm"),
    ),
    "all + opt-in, any order and case": (
        {"regions": ["MoE", "all"], "engine": "vllm-cpu"},
        AlignmentSpec(regions=("rope", "swiglu", "rmsnorm", "moe"), engine="vllm-cpu"),
    ),
    "verification settings": (
        {"regions": ["rope"], "engine": "vllm", "verify": {"every": 7, "on_worse": "warn", "ladder": "true"}},
        AlignmentSpec(
            regions=("rope",), engine="vllm", verify=VerifySpec(every=7, on_worse="warn", ladder=True)
        ),
    ),
    "doctor settings": (
        {"regions": ["rope"], "engine": "vllm", "doctor": {"allow": ["top_p_top_k", "Micro_Batch"]}},
        AlignmentSpec(
            regions=("rope",), engine="vllm", doctor=DoctorSpec(allow=("micro_batch", "top_p_top_k"))
        ),
    ),
    "experimental switches": (
        {
            "regions": [
                "rope",
                "swiglu",
                "rmsnorm",
                "lm_head",
            ],  # head_dtype sets lm_head's (refused without)
            "engine": "vllm-cpu",
            "metrics": "false",
            "experimental": {"compiled_norm": "yes", "unverified": ["moe"], "head_dtype": "bf16"},
        },
        AlignmentSpec(
            regions=("rope", "swiglu", "rmsnorm", "lm_head"),
            engine="vllm-cpu",
            metrics=False,
            experimental=Experimental(compiled_norm=True, unverified=("moe",), head_dtype="model"),
        ),
    ),
}


@pytest.mark.parametrize("surface", list(SURFACES))
@pytest.mark.parametrize("case", list(GOOD))
def test_every_surface_builds_the_same_spec(case: str, surface: str) -> None:
    node, want = GOOD[case]
    if surface == "flag" and "lm_head" in want.regions:
        with pytest.raises(
            AlignmentError, match="lm_head is not supported with OpenRLHF"
        ):  # it cannot set vLLM's head
            SURFACES[surface](node)
        return
    assert SURFACES[surface](node) == want


# request -> (error type, what the one line says on each surface: {surface: fragment}, or one fragment for all)
BAD = {
    "unknown region": ({"regions": ["rope", "swigl"]}, UnknownRegionError, "valid regions"),
    "unknown profile": ({"regions": ["rope"], "engine": "trt"}, UnknownProfileError, "valid profiles: vllm"),
    "moved key": (
        {"regions": ["rope"], "compile": "true"},
        ConfigFormatError,
        {
            "hydra": "alignment.compile moved to alignment.experimental.compile",
            "flag": "--alignment.compile moved to --alignment.experimental.compile",
        },
    ),
    "unknown experimental key": (
        {"regions": ["rope"], "experimental": {"compiled": "true"}},
        ConfigFormatError,
        {
            "hydra": "did you mean alignment.experimental.compile?",
            "flag": "--alignment.experimental.compile?",
        },
    ),
    "bad boolean": (
        {"regions": ["rope"], "metrics": "maybe"},
        ConfigFormatError,
        {
            "hydra": "alignment.metrics='maybe'",
            "flag": "--alignment.metrics='maybe'",
            "python": "metrics='maybe'",
        },
    ),
    "verify.every negative": (
        {"regions": ["rope"], "verify": {"every": "-3"}},
        ConfigFormatError,
        "give an integer >= 0",
    ),
    "verify.on_worse unknown": (
        {"regions": ["rope"], "verify": {"on_worse": "panic"}},
        ConfigFormatError,
        "use one of stop, warn",
    ),
    "unknown unverified name": (
        {"regions": ["rope"], "experimental": {"unverified": ["attention"]}},
        ConfigFormatError,
        "valid: moe",
    ),
    "unknown doctor finding": (
        {"regions": ["rope"], "doctor": {"allow": ["top_p"]}},
        ConfigFormatError,
        "valid: logprobs_mode, top_p_top_k",
    ),
    "unknown moe variant": (
        {"regions": ["rope"], "experimental": {"moe_variant": "fast"}},
        ConfigFormatError,
        "use one of emulate, engine-op",
    ),
}


@pytest.mark.parametrize("surface", list(SURFACES))
@pytest.mark.parametrize("case", list(BAD))
def test_every_bad_input_is_the_same_one_line_error(case: str, surface: str) -> None:
    node, err_type, fragment = BAD[case]
    if surface == "python" and case == "moved key":
        pytest.skip("the keyword form spells experimental switches at the top level (compile=True)")
    with pytest.raises(err_type) as info:
        SURFACES[surface](node)
    text = one_line(info.value)
    want = fragment.get(surface, "") if isinstance(fragment, dict) else fragment
    assert want in text and "\n" not in text


def test_the_wire_format_round_trips() -> None:
    spec = AlignmentSpec.parse(
        {
            "regions": "rope,moe",
            "engine": "vllm-cpu-eager",
            "verify": {"every": 3},
            "experimental": {"moe_variant": "engine-op", "unverified": "moe"},
            "engine_auto": True,
            "rollout": "vllm",
        }
    )
    assert AlignmentSpec.from_json(spec.to_json()) == spec
    assert AlignmentSpec.parse(json.loads(spec.to_json())) == spec
    env = Settings(spec, collect_rollout_logprobs=True).to_env()
    assert list(env) == ["RLALIGN_OPENRLHF"]  # one env var carries everything to the workers
    assert Settings.from_env(env) == Settings(spec, True)


def test_defaults_are_the_documented_ones() -> None:
    spec = AlignmentSpec()
    assert (spec.regions, spec.engine, spec.metrics) == ((), "auto", True)
    assert spec.verify == VerifySpec(
        enable=True, every=10, max_seqs=64, on_worse="stop", on_worse_later="warn"
    )
    assert spec.experimental.kernels == "torch" and not spec.experimental.compile


def test_verify_off_spelled_as_a_boolean() -> None:
    assert not AlignmentSpec.parse({"verify": "off"}).verify.enable
    assert not AlignmentSpec.parse({"verify": False}).verify.enable


def test_no_env_var_overrides_what_the_request_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spellings older releases read from the environment are gone: the driver's request is the one truth."""
    monkeypatch.setenv("RLALIGN_TRITON", "1")
    monkeypatch.setenv("RLALIGN_UNVERIFIED", "moe")
    spec = AlignmentSpec.parse(regions="rope", engine="vllm")
    assert spec.experimental.kernels == "torch" and spec.experimental.unverified == ()
    # ... and a retired variable left set is refused before anything is patched, naming the setting that replaced it
    for name, fix in (("RLALIGN_TRITON", "kernels=triton"), ("RLALIGN_UNVERIFIED", "unverified=[moe]")):
        with pytest.raises(ConfigFormatError) as info:
            validate_request(spec)
        assert one_line(info.value).count(name) == 1 and f"alignment.experimental.{fix}" in one_line(
            info.value
        )
        monkeypatch.delenv(name)
    assert validate_request(spec) is not None


def test_diagnose_settings_parse_through_the_spec() -> None:
    from rlalign_verl.tools.diagnose.options import parse_settings

    assert parse_settings("none,rope+swiglu,all,all+moe") == [
        ("none", ()),
        ("rope+swiglu", ("rope", "swiglu")),
        ("all", ("rope", "swiglu", "rmsnorm")),
        ("all+moe", ("rope", "swiglu", "rmsnorm", "moe")),
    ]
    with pytest.raises(UnknownRegionError):
        parse_settings("rope,ropes")


# --- validate: the one caller of every check --------------------------------------------------------

VALIDATE = {
    "triton with compile": (
        {"regions": "rope", "engine": "vllm", "experimental": {"kernels": "triton", "compile": True}},
        {},
        "both replace SwiGLU/RoPE",
    ),
    "triton on a CPU model": (
        {"regions": "rope", "engine": "vllm", "engine_auto": True, "experimental": {"kernels": "triton"}},
        {"device": "cpu", "rollout": "vllm"},
        "CUDA only",
    ),
    "compiled_norm without rmsnorm": (
        {"regions": "rope", "engine": "vllm-cpu", "experimental": {"compiled_norm": True}},
        {},
        "needs the rmsnorm region",
    ),
    "compiled_norm on a CUDA profile": (
        {"regions": "rmsnorm", "engine": "vllm", "experimental": {"compiled_norm": True}},
        {},
        "does not run its norms as an Inductor graph",
    ),
    "attention on a CUDA profile": ({"regions": "attention", "engine": "vllm"}, {}, "FlashAttention"),
    "tp alone at rollout TP 1": (
        {"regions": "tp", "engine": "vllm-cpu"},
        {},
        "change nothing at rollout tensor parallel 1",
    ),
    "an attention setting without the attention region": (
        {"regions": "rope", "engine": "vllm-cpu", "experimental": {"attention": "sdpa-fp32"}},
        {},
        "experimental.attention=sdpa-fp32 sets what the attention region computes",
    ),
    "a head dtype without the lm_head region": (
        {
            "regions": "rope,tp",
            "engine": "vllm-cpu",
            "rollout_tp": 2,
            "experimental": {"head_dtype": "model"},
        },
        {},
        "experimental.head_dtype=model sets what the lm_head region computes",
    ),
    "engine-op MoE on a CUDA profile": (
        {"regions": "swiglu,moe", "engine": "vllm", "experimental": {"moe_variant": "engine-op"}},
        {},
        "mirrors the vllm-cpu profiles only",
    ),
    "engine-op MoE on a dense model": (
        {"regions": "swiglu,moe", "engine": "vllm-cpu", "experimental": {"moe_variant": "engine-op"}},
        {"model_type": "qwen2"},
        "needs an MoE model",
    ),
    "unverified MoE data without the opt-in": (
        {"regions": "swiglu", "engine": "vllm"},
        {"model_type": "qwen3_moe"},
        "UNVERIFIED",
    ),
    "MoE with expert parallel": (
        {"regions": "swiglu", "engine": "vllm-cpu"},
        {"model_type": "qwen3_moe", "expert_parallel": 2},
        "expert parallel",
    ),  # fmt: skip
    "MoE combine with tensor parallel": (
        {"regions": "moe", "engine": "vllm-cpu", "rollout_tp": 2},
        {"model_type": "qwen2_moe"},
        "add tp to the regions",
    ),
    "hf profile with a real rollout": (
        {"regions": "rope", "engine": "hf"},
        {"rollout": "vllm"},
        "changes nothing",
    ),
    "sglang profile with a vllm rollout": (
        {"regions": "rope", "engine": "sglang"},
        {"rollout": "vllm"},
        "rollout",
    ),
    "explicit CPU profile on a CUDA worker": (
        {"regions": "rope", "engine": "vllm-cpu"},
        {"device": "cuda"},
        "alignment.engine=vllm",
    ),
    "fp16 model": ({"regions": "rope", "engine": "vllm"}, {"param_dtype": torch.float16}, "bfloat16"),
    "Liger": ({"regions": "rope", "engine": "vllm"}, {"liger": True}, "Liger"),
    "unsupported architecture": (
        {"regions": "rope", "engine": "vllm"},
        {"model_type": "gpt2"},
        "not supported",
    ),
    "gelu MLP with swiglu": (
        {"regions": ["rope", "swiglu"], "engine": "vllm"},
        {"model_type": "qwen2", "model_config": SimpleNamespace(hidden_act="gelu")},
        "computes silu only; drop swiglu",
    ),
    "lm_head in the class form": (
        {"regions": "lm_head", "engine": "vllm"},
        {"class_form": True},
        "needs a model",
    ),
}


@pytest.mark.parametrize("case", list(VALIDATE))
def test_validate_refuses_in_one_line(case: str) -> None:
    node, context, fragment = VALIDATE[case]
    with pytest.raises(AlignmentError) as info:
        validate_request(AlignmentSpec.parse(node), **context)
    text = one_line(info.value)
    assert fragment in text and "\n" not in text


def test_validate_moves_an_auto_profile_to_the_device() -> None:
    auto = AlignmentSpec.parse({"regions": "rope", "engine": "vllm", "engine_auto": True})
    assert validate_request(auto, device="cpu").name == "vllm-cpu"
    assert validate_request(AlignmentSpec(regions=("rope",)), device="cuda").name == "vllm"
    with pytest.raises(ProfileMismatchError):
        validate_request(AlignmentSpec.parse({"regions": "rope", "engine": "vllm"}), device="cpu")
    assert validate_request(AlignmentSpec()) is None  # alignment off: nothing to check


@pytest.mark.parametrize(
    "argv",
    [
        ["--alignment.verify.every", "10", "--alignment.verify", "off"],
        ["--alignment.verify", "off", "--alignment.verify.every", "10"],
    ],
)
def test_a_flag_and_its_sub_flags_conflict_in_either_order(argv: list[str]) -> None:
    """Neither order silently drops a setting (``verify off`` after ``verify.every 10`` would erase it)."""
    with pytest.raises(ConfigFormatError, match="conflicts with"):
        parse_launcher_args([*argv, "--alignment.regions", "rope"])


def test_a_non_silu_mlp_is_fine_when_its_regions_are_off() -> None:
    """Only the regions that compute silu (swiglu, moe) care about the activation."""
    spec = AlignmentSpec.parse({"regions": ["rope", "rmsnorm"], "engine": "vllm"})
    assert (
        validate_request(spec, model_type="qwen2", model_config=SimpleNamespace(hidden_act="gelu")).name
        == "vllm"
    )
