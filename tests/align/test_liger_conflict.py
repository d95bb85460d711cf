"""A model patched by the real Liger kernels is refused with a message saying why.

Liger's patch functions replace module-level functions of transformers (e.g.
``modeling_qwen2.apply_rotary_pos_emb``), so each case runs in a fresh subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("liger_kernel")

SCRIPT = textwrap.dedent(
    """
    import torch
    from transformers import Qwen2Config, AutoModelForCausalLM
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2
    from rlalign_verl.base.errors import LigerConflictError
    from rlalign_verl.align.patch import apply_alignment, get_alignment

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=100)
    MODE = {mode!r}
    if MODE == "instance":
        model = AutoModelForCausalLM.from_config(cfg)
        apply_liger_kernel_to_qwen2(model=model, rope=False, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    else:  # class-level Liger patch, model built afterwards
        apply_liger_kernel_to_qwen2(rope=True, rms_norm=False, swiglu=False, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
        model = AutoModelForCausalLM.from_config(cfg)
    try:
        apply_alignment(model, regions=["rope"], engine="vllm")
    except LigerConflictError as e:
        assert get_alignment(model) is None
        print("REFUSED:", e)
    else:
        raise SystemExit("Liger-patched model was not refused")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["instance", "class"])
def test_liger_patched_model_is_refused(mode: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(mode=mode)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED: this model was patched by Liger kernels" in out.stdout
    assert "use_liger=False" in out.stdout
