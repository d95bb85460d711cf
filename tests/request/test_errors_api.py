"""Bad inputs to the Python API: one row per input -> exception type and a fragment of the one-line fix;
plus alignment overridden after the fact (Liger re-patching, replaced forwards, swapped modules)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from rlalign_verl import apply_alignment, get_alignment, remove_alignment
from rlalign_verl.base.errors import (
    AlignmentOverriddenError,
    ConfigFormatError,
    UnknownProfileError,
    UnknownRegionError,
    UnsupportedModelError,
    one_line,
)

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, vocab_size=100)  # fmt: skip


def tiny(device: str = "cpu") -> torch.nn.Module:
    with torch.device(device):
        return AutoModelForCausalLM.from_config(Qwen2Config(**CFG), dtype=torch.bfloat16)


# id -> (model factory, kwargs to apply_alignment, exception type, fragment of the message)
BAD = {
    "a path instead of a model": (
        lambda: "Qwen/Qwen2.5-0.5B",
        {},
        UnsupportedModelError,
        "from_pretrained(path)",
    ),
    "a state dict": (lambda: tiny().state_dict(), {}, UnsupportedModelError, "got a OrderedDict"),
    "a module without HF config": (
        lambda: torch.nn.Linear(2, 2),
        {},
        UnsupportedModelError,
        "config.model_type",
    ),
    "regions=5": (tiny, {"regions": 5}, ConfigFormatError, "regions=5: give a list of region names"),
    "regions typo": (tiny, {"regions": "rope,swigl"}, UnknownRegionError, "valid regions"),
    "engine typo": (tiny, {"engine": "trtllm"}, UnknownProfileError, "valid profiles"),
    "engine a number": (tiny, {"engine": 5}, UnknownProfileError, "valid profiles"),
    "compile='maybe'": (tiny, {"compile": "maybe"}, ConfigFormatError, "compile=false"),
    "kernels a number": (tiny, {"kernels": 5}, ConfigFormatError, "kernels=5: use one of torch, triton"),
    # values that used to turn alignment off or fall back to a default without a word (issue 34)
    "regions=None": (tiny, {"regions": None}, ConfigFormatError, "or [] to turn it off"),
    "regions=[None]": (tiny, {"regions": [None]}, ConfigFormatError, "holds None, not a region name"),
    "regions=[rope, 3]": (tiny, {"regions": ["rope", 3]}, ConfigFormatError, "holds 3, not a region name"),
    "engine=False": (tiny, {"engine": False}, ConfigFormatError, "engine=False: give auto or a profile name"),
    "engine=0": (tiny, {"engine": 0}, ConfigFormatError, "engine=0: give auto or a profile name"),
    "engine=''": (tiny, {"engine": ""}, ConfigFormatError, "give auto or a profile name"),
    "attention=''": (
        tiny,
        {"regions": "all,attention", "engine": "vllm-cpu", "attention": ""},
        ConfigFormatError,
        "attention='': use one of engine-op, sdpa-fp32",
    ),  # fmt: skip
    "kernels=False": (tiny, {"kernels": False}, ConfigFormatError, "use one of torch, triton"),
    "head_dtype=''": (
        tiny,
        {"regions": "lm_head", "head_dtype": ""},
        ConfigFormatError,
        "use one of float32, model",
    ),
    "moe_variant=0": (tiny, {"moe_variant": 0}, ConfigFormatError, "use one of emulate, engine-op"),
    "unverified=[None]": (tiny, {"unverified": [None]}, ConfigFormatError, "give names: moe"),
    # a region or opt-in that would change nothing on this model is refused, not reported as aligned
    "moe on a dense model": (
        tiny,
        {"regions": "all,moe", "engine": "vllm-cpu"},
        UnsupportedModelError,
        "qwen2 is a dense model (it has none): it would align nothing; drop moe",
    ),  # fmt: skip
    "moe alone on a dense model": (
        tiny,
        {"regions": "moe", "engine": "vllm-cpu"},
        UnsupportedModelError,
        "drop moe from the regions",
    ),  # fmt: skip
    "unverified=[moe] on a dense model": (
        tiny,
        {"unverified": ["moe"]},
        UnsupportedModelError,
        "the dense qwen2 never uses; drop it",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_api_input_is_a_typed_one_line_error(case):
    make, kwargs, exc_type, fragment = BAD[case]
    model = make()
    with pytest.raises(exc_type) as info:
        apply_alignment(model, **kwargs)
    line = one_line(info.value)
    assert fragment in line and "\n" not in line, line
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        assert get_alignment(model) is None  # nothing half-applied


def test_json_spec_engine_auto_false_reads_false():
    """A JSON/dict spec's engine_auto is parsed as a boolean: the text "false" used to read as True."""
    from rlalign_verl.request.spec import AlignmentSpec

    spec = AlignmentSpec.parse({"regions": ["rope"], "engine": "vllm", "engine_auto": "false"})
    assert spec.engine_auto is False
    assert (
        AlignmentSpec.parse({"regions": ["rope"], "engine": "vllm", "engine_auto": "true"}).engine_auto
        is True
    )
    with pytest.raises(ConfigFormatError, match="engine_auto='maybe' is not a boolean"):
        AlignmentSpec.parse({"regions": ["rope"], "engine": "vllm", "engine_auto": "maybe"})
    assert AlignmentSpec.parse({}).regions == ()  # a missing regions key: off (the Hydra default is [])


def test_the_model_is_taken_by_keyword_or_position():
    """apply_alignment / aligned / remove_alignment take ``model=`` like Liger's apply_liger_kernel_to_*(model=)."""
    from rlalign_verl import aligned
    from rlalign_verl.request.spec import AlignmentSpec

    by_keyword = apply_alignment(model=tiny(), regions=["rope"], engine="vllm")
    assert get_alignment(by_keyword).regions == ("rope",)
    remove_alignment(model=by_keyword)
    assert get_alignment(by_keyword) is None
    by_spec = apply_alignment(model=tiny(), spec=AlignmentSpec.parse(regions=["swiglu"], engine="vllm"))
    assert get_alignment(by_spec).regions == ("swiglu",)
    with aligned(model=by_keyword, regions="rmsnorm", engine="vllm") as m:
        assert get_alignment(m).regions == ("rmsnorm",)
    assert get_alignment(by_keyword) is None


def test_engine_auto_follows_the_model_device_and_says_so(caplog):
    """engine=auto in Python picks the engine build of the model's device (a CPU model: vllm-cpu, not the CUDA
    vllm profile) and says which at INFO, on a logger with its own stderr handler (shown although the user set up
    no logging: the root logger's last-resort handler would drop an INFO line)."""
    import logging

    said = logging.getLogger("rlalign_verl.align")
    said.addHandler(caplog.handler)
    try:
        model = apply_alignment(tiny(), regions=["rmsnorm"], engine="auto")
    finally:
        said.removeHandler(caplog.handler)
    assert get_alignment(model).profile.name == "vllm-cpu"
    assert any(
        "engine=auto chose profile vllm-cpu for a model on cpu" in r.getMessage() for r in caplog.records
    )
    assert said.isEnabledFor(logging.INFO) and not said.propagate
    assert any(isinstance(h, logging.StreamHandler) and h is not caplog.handler for h in said.handlers)


def test_compile_false_as_text_means_not_compiled():
    model = apply_alignment(tiny(), regions="rope", engine="vllm", compile="false")
    assert get_alignment(model).compiled is False


def test_meta_device_model_traces_shapes():
    """A meta model (FSDP's deferred init, shape tracing) aligns and runs a meta forward like HF's."""
    model = apply_alignment(tiny("meta"), regions="all", engine="vllm")
    out = model(torch.zeros(1, 5, dtype=torch.long, device="meta")).logits
    assert out.device.type == "meta" and tuple(out.shape) == (1, 5, CFG["vocab_size"])


def _replace_forward(model):
    model.model.layers[1].mlp.forward = lambda x: x
    return "model.layers.1.mlp"


def _swap_module(model):
    model.model.layers[0].mlp = Qwen2MLP(model.config).to(torch.bfloat16)
    return "a new Qwen2MLP"


def _rebind_norm(model):
    norm = model.model.norm
    norm.forward = type(norm).forward.__get__(norm)
    return "model.norm"


OVERRIDES = {
    "forward replaced": _replace_forward,
    "module swapped": _swap_module,
    "norm rebound": _rebind_norm,
}


@pytest.mark.parametrize("case", list(OVERRIDES))
def test_get_alignment_reports_an_overridden_alignment(case):
    model = apply_alignment(tiny(), regions="all", engine="vllm")
    assert get_alignment(model).regions == ("rope", "swiglu", "rmsnorm")
    fragment = OVERRIDES[case](model)
    with pytest.raises(AlignmentOverriddenError, match="overridden after apply_alignment") as info:
        get_alignment(model)
    assert fragment in str(info.value)
    remove_alignment(model)  # removal still works and leaves a clean model
    assert get_alignment(model) is None


LIGER_SCRIPT = textwrap.dedent(
    """
    import torch
    from transformers import Qwen2Config, AutoModelForCausalLM
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2
    from rlalign_verl import apply_alignment, get_alignment
    from rlalign_verl.base.errors import AlignmentOverriddenError

    cfg = Qwen2Config(**{cfg!r})
    model = apply_alignment(AutoModelForCausalLM.from_config(cfg), regions={regions!r}, engine="vllm")
    apply_liger_kernel_to_qwen2(model=model, rope=False, cross_entropy=False, fused_linear_cross_entropy=False,
                                rms_norm={rms_norm!r}, swiglu={swiglu!r})
    try:
        print("STILL", get_alignment(model).describe())
    except AlignmentOverriddenError as e:
        print("DETECTED:", e)
    """
)


@pytest.mark.parametrize(
    ("regions", "rms_norm", "swiglu", "fragment"),
    [
        ("all", False, True, "model.layers.0.mlp (liger_kernel"),
        ("all", True, False, "model.norm (liger_kernel"),
        ("rope", True, True, "liger_kernel"),  # Liger norms/MLPs around an aligned RoPE change the rest too
    ],
)
@pytest.mark.slow
def test_liger_repatching_after_alignment_is_detected(regions, rms_norm, swiglu, fragment):
    pytest.importorskip("liger_kernel")
    script = LIGER_SCRIPT.format(cfg=CFG, regions=regions, rms_norm=rms_norm, swiglu=swiglu)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DETECTED: the alignment of Qwen2ForCausalLM" in out.stdout, out.stdout
    assert fragment in out.stdout and "use_liger=False" in out.stdout, out.stdout
