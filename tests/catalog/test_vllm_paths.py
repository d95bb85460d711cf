"""Which vLLM path a compilation_config describes, in each spelling vLLM prints (facts written here: vLLM 0.31
``CompilationMode`` NONE=0, STOCK_TORCH_COMPILE=1, DYNAMO_TRACE_ONCE=2, VLLM_COMPILE=3; the CPU build runs 2)."""

from __future__ import annotations

import pytest

from rlalign_verl.catalog.vllm_paths import compilation_mode, kernels_on


@pytest.mark.parametrize(
    ("cc", "path"),
    [
        ({}, None),
        ({"mode": 0}, "eager"),
        ({"mode": "NONE"}, "eager"),
        ({"mode": "none"}, "eager"),
        ({"mode": "CompilationMode.NONE"}, "eager"),
        ({"level": 0}, "eager"),
        ({"level": "NO_COMPILATION"}, "eager"),
        ({"mode": "0"}, "eager"),
        ({"mode": 2}, "compiled"),
        ({"mode": "DYNAMO_TRACE_ONCE"}, "compiled"),
        ({"mode": 3}, "compiled"),
        ({"mode": "VLLM_COMPILE"}, "compiled"),
        ({"level": "PIECEWISE"}, "compiled"),
        ({"mode": 1}, "compiled"),
        ({"mode": 3, "level": 0}, "compiled"),
    ],  # fmt: skip
)
def test_the_mode_in_each_spelling(cc, path):
    assert compilation_mode(cc) == path


@pytest.mark.parametrize("mode", [4, -1, "FAST", "", True, False, 3.5])
def test_a_mode_vllm_does_not_have_is_refused(mode):
    with pytest.raises(ValueError, match="not a vLLM compilation mode"):
        compilation_mode({"mode": mode})


@pytest.mark.parametrize(
    ("ops", "on"),
    [
        ([], False),
        (["none"], False),
        (["all"], True),
        (["+rms_norm", "+silu_and_mul", "+rotary_embedding"], True),
        (["all", "-rms_norm"], None),
        (["+rms_norm"], None),
        (["-rms_norm"], False),
        (["+quant_fp8"], False),
    ],  # fmt: skip
)
def test_which_region_kernels_run(ops, on):
    assert kernels_on(ops) is on
