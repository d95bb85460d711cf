"""Request edges, round 4: a spec that names no regions, keywords merged into a mapping, an empty region string, a
key given twice, a setting that acts only on aligned regions while alignment is off, too few verify sequences."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlalign_verl import apply_alignment, get_alignment
from rlalign_verl.base.errors import AlignmentError, ConfigFormatError
from rlalign_verl.request.checks import validate_request
from rlalign_verl.request.spec import MIN_VERIFY_SEQS, AlignmentSpec


def _tiny() -> torch.nn.Module:
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=32)  # fmt: skip
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("spec", [{"engine": "vllm-cpu"}, '{"engine": "vllm-cpu"}', "{}", {}])
def test_a_python_spec_without_regions_is_refused_not_read_as_off(spec):
    """The keyword form defaults to the three regions; a dict/JSON spec without ``regions`` aligned nothing."""
    model = _tiny()
    with pytest.raises(ConfigFormatError, match="names no regions"):
        apply_alignment(model, spec)
    assert get_alignment(model) is None
    assert get_alignment(apply_alignment(model, {"regions": ["rope"], "engine": "vllm-cpu"})).regions == (
        "rope",
    )


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("null", "names no regions"),
        ("[]", "not a mapping"),
        ('"rope"', "not a mapping"),
        ("3", "not a mapping"),
    ],
)
def test_a_json_spec_that_is_not_an_object_is_refused(spec, words):
    model = _tiny()
    with pytest.raises(ConfigFormatError, match=words):
        apply_alignment(model, spec)
    assert get_alignment(model) is None


def test_keywords_merge_into_a_mapping_section_by_section():
    spec = AlignmentSpec.parse({"regions": ["rope"], "experimental": {"compile": True}}, kernels="torch")
    assert spec.experimental.compile is True and spec.experimental.kernels == "torch"
    spec = AlignmentSpec.parse({"regions": ["rope"], "verify": {"every": 3}}, verify=False)
    assert spec.verify.every == 3 and spec.verify.enable is False


@pytest.mark.parametrize("spelling", ["hydra", "flag", "python"])
@pytest.mark.parametrize("value", ["", " ", ",", " , "])
def test_an_empty_region_string_is_refused(value, spelling):
    """'' (an unset variable, ``alignment.regions=''``) turned alignment off without a word; [] / none say it."""
    with pytest.raises(ConfigFormatError, match="names no region") as e:
        AlignmentSpec.parse(regions=value, spelling=spelling)
    assert "\n" not in str(e.value)
    assert AlignmentSpec.parse(regions=[], spelling=spelling).regions == ()
    assert AlignmentSpec.parse(regions="none", spelling=spelling).regions == ()


@pytest.mark.parametrize(
    "text",
    ['{"regions": ["rope"], "regions": []}', '{"regions": ["rope"], "verify": {"every": 1, "every": 5}}'],
)
def test_a_key_given_twice_in_a_json_spec_is_refused(text):
    with pytest.raises(ConfigFormatError, match="duplicate key"):
        AlignmentSpec.parse(text)


@pytest.mark.parametrize(
    ("setting", "spelled"),
    [
        ({"compile": True}, {"hydra": "alignment.experimental.compile=true", "python": "compile=True"}),
        (
            {"kernels": "triton"},
            {
                "hydra": "alignment.experimental.kernels=triton",
                "flag": "--alignment.experimental.kernels triton",
            },
        ),
        (
            {"unverified": ["moe"]},
            {"hydra": "alignment.experimental.unverified=[moe]", "python": "unverified=('moe',)"},
        ),
        ({"compiled_norm": True}, {"flag": "--alignment.experimental.compiled_norm true"}),
        ({"moe_variant": "engine-op"}, {"hydra": "alignment.experimental.moe_variant=engine-op"}),
        ({"attention": "sdpa-fp32"}, {"hydra": "alignment.experimental.attention=sdpa-fp32"}),
        ({"head_dtype": "model"}, {"hydra": "alignment.experimental.head_dtype=model"}),
    ],
)
def test_a_setting_that_acts_only_on_aligned_regions_is_refused_with_alignment_off(setting, spelled):
    spec = AlignmentSpec.parse({"regions": [], "experimental": setting})
    for spelling, words in spelled.items():
        with pytest.raises(AlignmentError, match="alignment off") as e:
            validate_request(spec, spelling=spelling)
        assert words in str(e.value), (spelling, str(e.value))


def test_alignment_off_keeps_its_own_settings_and_python_refuses_too():
    quiet = AlignmentSpec.parse({"regions": [], "metrics": False, "experimental": {"metrics_quantiles": False,
                                 "untested_versions": True}})  # fmt: skip
    assert validate_request(quiet) is None  # metrics settings act with alignment off
    with pytest.raises(AlignmentError, match="compile=True changes what aligned regions compute"):
        apply_alignment(_tiny(), regions=[], compile=True)


def test_verify_needs_the_sequences_a_verdict_is_decided_on():
    from rlalign_verl.measure.intervals import MIN_UNITS

    assert MIN_VERIFY_SEQS == MIN_UNITS == 8
    with pytest.raises(ConfigFormatError, match=r"verify.max_seqs=7: give an integer >= 8: a verdict needs"):
        AlignmentSpec.parse({"regions": ["rope"], "verify": {"max_seqs": 7}})
    assert AlignmentSpec.parse({"regions": ["rope"], "verify": {"max_seqs": 8}}).verify.max_seqs == 8


def test_describe_names_each_setting_once():
    line = AlignmentSpec.parse(regions="rope,moe", unverified=["moe"], spelling="python").describe()
    assert line.count("unverified=moe") == 1, line


def test_a_section_given_as_a_word_names_a_key_of_that_section():
    with pytest.raises(ConfigFormatError, match=r"alignment.doctor=disabled: .*alignment.doctor.enable"):
        AlignmentSpec.parse({"regions": ["rope"], "doctor": "disabled"})


def test_a_misspelt_regions_key_is_named_before_the_missing_regions():
    with pytest.raises(ConfigFormatError, match="region") as e:
        apply_alignment(_tiny(), {"region": ["rope"]})
    assert "names no regions" not in str(e.value), str(e.value)
