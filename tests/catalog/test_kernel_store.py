"""The bf16 store of vLLM's CPU C++ kernels: round to nearest with AVX512-BF16, truncation without.

``RopeRounding.store`` / ``MoeRounding.store`` = ``"vllm-cpu-kernel"`` follow the host
(:func:`rlalign_verl.catalog.placement.vllm_cpu_kernel_store`); this pins the primitive against a numpy bit-mask
reference, its straight-through gradient, the host resolution, and, with the engine installed, what the
kernels loaded here really do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlalign_verl.align.regions._precision import store_as, truncate_bf16
from rlalign_verl.base.errors import ProfileMismatchError
from rlalign_verl.catalog.placement import vllm_cpu_kernel_store

BF = torch.bfloat16


def numpy_truncate(x: torch.Tensor) -> torch.Tensor:
    bits = x.detach().float().numpy().view(np.uint32) & np.uint32(0xFFFF0000)
    return torch.from_numpy(bits.view(np.float32).copy())


def test_truncate_matches_bit_mask_and_passes_gradients() -> None:
    x = (
        torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 10.0 ** torch.randint(-3, 4, (4096,))
    ).float()
    x.requires_grad_(True)
    t = truncate_bf16(x)
    assert torch.equal(t.detach(), numpy_truncate(x))
    assert (t.detach().abs() <= x.detach().abs()).all()  # toward zero
    assert (t.detach().to(BF).float() == t.detach()).all()  # a bf16 value: the cast is exact
    assert (t.detach() != x.detach().to(BF).float()).float().mean() > 0.3  # and not round-to-nearest
    g = torch.randn(4096)
    t.backward(g)
    assert torch.equal(x.grad, g)  # straight through, as a cast's gradient


@pytest.mark.parametrize("avx512_bf16, want", [(True, "nearest"), (False, "truncate")])
def test_host_store_follows_vllms_kernel_choice(monkeypatch, avx512_bf16: bool, want: str) -> None:
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert vllm_cpu_kernel_store() == want
    x = torch.tensor([1.0 + 2.0**-8 + 2.0**-9])  # between two bf16 values, nearer the upper one
    assert store_as(x, "vllm-cpu-kernel", BF).item() == (1.0 + 2.0**-7 if want == "nearest" else 1.0)


def test_non_x86_host_is_refused_in_one_line(monkeypatch) -> None:
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    with pytest.raises(ProfileMismatchError, match="x86_64 only") as e:
        vllm_cpu_kernel_store()
    assert "\n" not in str(e.value) and "alignment.engine=vllm-cpu" in str(e.value)
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlalign_verl.align.patch import apply_alignment, get_alignment

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, dtype=BF)
    with pytest.raises(
        ProfileMismatchError, match="x86_64 only"
    ):  # at apply time, before anything is patched
        apply_alignment(model, regions=["rope"], engine="vllm-cpu-eager")
    assert get_alignment(model) is None
    assert (
        apply_alignment(model, regions=["rope"], engine="vllm-cpu") is model
    )  # compiled RoPE: no C++ kernel


@pytest.mark.engine
def test_loaded_vllm_kernels_store_as_resolved() -> None:
    """The claim itself, on whatever CPU runs this: silu_and_mul's bf16 output is the resolved store of its
    fp32 result, bit for bit (100% of 64k elements; the other store matches about half)."""
    pytest.importorskip("vllm")
    import vllm._custom_ops  # noqa: F401  - loads _C / _C_AVX512 / _C_AVX2 as the engine does

    x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(1)).to(BF)
    out = torch.empty(128, 512, dtype=BF)
    torch.ops._C.silu_and_mul(out, x)
    g, u = x.float().chunk(2, -1)
    f = torch.nn.functional.silu(g) * u
    host = store_as(f, "vllm-cpu-kernel", BF)
    other = store_as(f, "truncate" if vllm_cpu_kernel_store() == "nearest" else "nearest", BF)
    assert torch.equal(out, host)
    assert (out == other).float().mean() < 0.8
