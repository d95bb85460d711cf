"""Mutation check of the MoE fields: every ``MoeRounding`` field of every profile that has one, every other value.

A one-layer tiny Qwen3-MoE (8 experts, top-2, ``norm_topk_prob`` both ways) is aligned with the mutated
profile (regions swiglu + moe). The router's weights and the experts' combined output are recorded and
checked against a reference of the *original* profile written here from the ``MoeRounding`` spec: float64
math with explicit ``R()`` (bf16) and ``F()`` (fp32) at the spec's rounding points, teacher-forced with the
run's own router logits and expert choices. The original must pass; each mutant must fail a check.

With ``norm_topk_prob=False`` all 41 mutations (hf, vllm-cpu, vllm-cpu-eager, vllm, vllm-eager, sglang) are killed. With
``norm_topk_prob=True`` ``router_softmax`` survives: the renormalised top-k of the full softmax and the softmax
over the top k are the same number, and the two differ only in the last fp32 bits (below a bf16 rounding).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from rlalign_verl.align.patch import apply_alignment, remove_alignment
from rlalign_verl.catalog.profiles import PROFILES

BF, F64 = torch.bfloat16, torch.float64
H, INTER, E, K, T = 64, 32, 8, 3, 96  # top-3: a bf16 running sum of 3 slots differs from one fp32 sum
TOLERANCE = 0.003  # float64 vs fp32 math: a few last-bit flips per thousand bf16 outputs at most
VALUES = {
    "expert_gemm": ("bf16", "fp32"), "expert_act_roundings": (1, 2), "router_softmax": ("all", "topk"),
    "weights_dtype": ("bf16", "fp32"), "combine": ("bf16", "fp32", "slot"),
    "slot_sum_bf16_max_k": (K, K - 1),  # top-k summed in bf16 (k <= max) or in fp32; only used by "slot"
    "block_sum": ("bf16", "fp32", "fused"),  # Qwen2-MoE's shared + routed sum: test_every_block_sum_mutation_is_killed
    "store": ("nearest", "truncate", "vllm-cpu-kernel"),  # the fused expert kernel's bf16 stores (expert_gemm="fp32")
}  # fmt: skip
# what "vllm-cpu-kernel" means on this host, decided here from the CPU flag vLLM's kernel loader reads
HOST_STORE = "nearest" if torch.cpu._is_avx512_bf16_supported() else "truncate"
NOT_ROUNDING = {"verified"}  # whether the data was checked against the engine: no number depends on it


def R(x: torch.Tensor) -> torch.Tensor:
    """Stored in bf16 (from float64 math, through fp32 as an fp32 kernel rounds)."""
    return x.to(torch.float32).to(BF).to(F64)


def TR(x: torch.Tensor) -> torch.Tensor:
    """Stored in bf16 by truncation (fp32 result, low 16 bits dropped), as vLLM's CPU kernels without AVX512-BF16."""
    bits = x.detach().to(torch.float32).numpy().view(np.uint32) & np.uint32(0xFFFF0000)
    return torch.from_numpy(bits.view(np.float32)).to(F64)


def S(m):
    """The fused kernel's bf16 store of ``m``: ``R`` or ``TR``."""
    return TR if (HOST_STORE if m.store == "vllm-cpu-kernel" else m.store) == "truncate" else R


def F(x: torch.Tensor) -> torch.Tensor:
    """An fp32 result."""
    return x.to(torch.float32).to(F64)


def lse_bf16_ops(x: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` as bf16 eager ops run it: max, exp(x - max), sum, log, + max, each output stored in bf16."""
    m = x.amax(-1, keepdim=True)
    return R(R(torch.log(R(R(torch.exp(R(x - m))).sum(-1, keepdim=True)))) + m)


def ref_weights(logits: torch.Tensor, idx: torch.Tensor, renorm: bool, m) -> torch.Tensor:
    """Routing weights of the chosen experts ``idx`` from bf16 ``logits`` (float64 values), per spec."""
    if m.router_softmax == "all":  # fp32 softmax over all experts, top-k of it, renormalised by division
        w = F(torch.softmax(logits, -1)).gather(-1, idx)
        w = F(w / F(w.sum(-1, keepdim=True))) if renorm else w
    elif renorm:  # softmax over the k chosen logits only
        w = F(torch.softmax(logits.gather(-1, idx), -1))
    elif m.weights_dtype == "bf16":  # eager bf16 ops: exp(v - logsumexp), each op's output stored in bf16
        w = R(torch.exp(R(logits.gather(-1, idx) - lse_bf16_ops(logits))))
    else:  # compiled: only the logsumexp reduction is stored (bf16), the rest stays fp32
        w = F(torch.exp(logits.gather(-1, idx) - R(torch.logsumexp(logits, -1, keepdim=True))))
    return R(w) if m.weights_dtype == "bf16" else w


def ref_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, m) -> torch.Tensor:
    """One expert ``down(silu(g) * u)``: GEMM outputs stored in bf16, or kept fp32 (fused kernel); with
    ``combine="slot"`` the down GEMM's fp32 accumulator goes to the weight multiply unstored."""
    store = R if m.expert_gemm == "bf16" else F
    g, u = store(x @ gate_up.T).chunk(2, -1)
    silu = F(g / (1.0 + torch.exp(-g)))
    act = R(R(silu) * u) if m.expert_act_roundings == 2 else S(m)(silu * u)
    return (F if m.combine == "slot" else store)(act @ down.T)


def ref_combine(x, idx, w, gate_up, down, m) -> torch.Tensor:
    """``sum_k w_k d_k``: bf16 running sum of rounded products (experts ascending), or fp32 then one rounding."""
    if m.combine == "slot":  # R(w_k d_k) per slot, then summed in slot order
        slots = torch.zeros((*idx.shape, x.shape[-1]), dtype=F64)
        for t, j in zip(*torch.where(idx >= 0), strict=True):
            e = idx[t, j]
            slots[t, j] = R(w[t, j] * ref_expert(x[t, None], gate_up[e], down[e], m)[0])
        if K > m.slot_sum_bf16_max_k:
            return R(slots.sum(1))  # fp32 accumulation, one rounding
        acc = slots[:, 0]
        for j in range(1, K):
            acc = R(acc + slots[:, j])  # a bf16 running sum: each add rounds
        return acc
    out = torch.zeros(x.shape, dtype=F64)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        d, we = ref_expert(x[tok], gate_up[e], down[e], m), w[tok, slot, None]
        out[tok] = R(out[tok] + R(R(d) * R(we))) if m.combine == "bf16" else F(out[tok] + F(d * we))
    return R(out) if m.combine == "bf16" else S(m)(out)


def build(renorm: bool) -> torch.nn.Module:
    cfg = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, intermediate_size=64, num_experts=E, num_experts_per_tok=K,
        norm_topk_prob=renorm, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        vocab_size=128, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=BF)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "gate.weight" in name else 0.1) if p.dim() > 1 else p.normal_(1.0, 0.2)
    return model.eval()


def capture(model, profile) -> dict:
    """Run ``model`` aligned (swiglu + moe) to ``profile``; record the router and the experts' I/O."""
    mlp = model.model.layers[0].mlp
    rec: dict = {}
    hooks = [
        mlp.gate.register_forward_hook(lambda m, a, o: rec.update(logits=o[0], weights=o[1], idx=o[2])),
        mlp.experts.register_forward_hook(lambda m, a, o: rec.update(x=a[0], w_in=a[2], out=o)),
    ]
    try:
        apply_alignment(model, regions=("swiglu", "moe"), engine=profile, unverified=("moe",))
        with torch.no_grad():
            model(torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(1)))
    finally:
        for h in hooks:
            h.remove()
        remove_alignment(model)
    return rec


def mismatch(got: torch.Tensor, want: torch.Tensor, ulps: int = 0) -> float:
    """Fraction of elements that differ (by more than ``ulps`` fp32 units in the last place)."""
    return float(((got.to(F64) - want).abs() > ulps * 2.0**-23 * want.abs()).float().mean())


def failed_checks(model, rec: dict, m) -> list[str]:
    """The checks where the run ``rec`` disagrees with the reference of ``MoeRounding`` ``m``."""
    ex, d = model.model.layers[0].mlp.experts, lambda t: t.detach().to(F64)
    renorm = model.config.norm_topk_prob
    bad = []
    want_w = ref_weights(d(rec["logits"]), rec["idx"], renorm, m)
    if rec["weights"].dtype != (BF if m.weights_dtype == "bf16" else torch.float32):
        bad.append("router/dtype")
    # fp32 weights: torch's fp32 exp/softmax vs float64-then-round differ in the last fp32 bits (not a rounding
    # location); 4 fp32 ulps is far below what a misplaced bf16 rounding moves (2**-9 relative)
    if mismatch(rec["weights"], want_w, ulps=0 if m.weights_dtype == "bf16" else 4) > TOLERANCE:
        bad.append("router/weights")
    want = ref_combine(d(rec["x"]), rec["idx"], d(rec["w_in"]), d(ex.gate_up_proj), d(ex.down_proj), m)
    if mismatch(rec["out"], want) > TOLERANCE:
        bad.append("experts/combine")
    return bad


def moe_mutations(moe) -> list[tuple[str, object]]:
    """``(field=value, mutated MoeRounding)`` for every other allowed value of every MoE field."""
    out = []
    for f, values in VALUES.items():
        if f == "block_sum":
            continue  # needs a shared expert (Qwen2-MoE): its own test below
        if f == "slot_sum_bf16_max_k":
            if moe.combine != "slot":
                continue  # the field only applies to combine="slot" (its combine mutation is listed)
            values = (
                (K - 1,) if moe.slot_sum_bf16_max_k >= K else (K,)
            )  # the other side of this model's top-k
        if f == "store" and "fp32" not in (moe.expert_gemm, moe.combine):
            continue  # only the fused (fp32) expert kernel has a store choice
        out += [(f"{f}={v}", _replace(moe, f, v)) for v in values if v != getattr(moe, f)]
    return out


def _replace(moe, f: str, v):
    try:
        return dataclasses.replace(moe, **{f: v})
    except ValueError:  # bf16 GEMM and combine leave no store choice: the mutant stores to nearest
        return dataclasses.replace(moe, **{f: v, "store": "nearest"})


def same_store_here(a, b) -> bool:
    """Two store values that are one rounding on this host (e.g. vllm-cpu-kernel and nearest with AVX512-BF16)."""
    return S(a) is S(b)


def test_values_cover_every_moe_field() -> None:
    from rlalign_verl.catalog.profiles import MoeRounding

    assert set(VALUES) | NOT_ROUNDING == {f.name for f in dataclasses.fields(MoeRounding)}
    for f, values in VALUES.items():  # each listed value is allowed, and nothing else is
        base = {"expert_gemm": "fp32"} if f == "store" else {}  # a store choice needs an fp32 result
        for v in values:
            MoeRounding(**base, **{f: v})
        with pytest.raises((ValueError, TypeError)):
            MoeRounding(**base, **{f: "other"})
    with pytest.raises(ValueError):  # a store choice needs the fused kernel's fp32 results
        MoeRounding(expert_gemm="bf16", combine="bf16", store="truncate")


@pytest.mark.parametrize("renorm", [False, True], ids=["norm_topk_prob=False", "norm_topk_prob=True"])
def test_every_moe_mutation_is_killed(renorm: bool, capsys, monkeypatch) -> None:
    model = build(renorm)
    total, survivors, killed_by = 0, [], {}
    for name, p in PROFILES.items():
        if p.moe is None:
            continue
        assert failed_checks(model, capture(model, p), p.moe) == [], f"{name}: the original must pass"
        for label, moe in moe_mutations(p.moe):
            if label.startswith("store=") and same_store_here(moe, p.moe):
                continue  # the same bf16 store on this host (printed below as host-equal)
            total += 1
            bad = failed_checks(model, capture(model, dataclasses.replace(p, moe=moe)), p.moe)
            killed_by[f"{name}:{label}"] = bad
            if not bad:
                survivors.append(f"{name}:{label}")
    with capsys.disabled():
        print(
            f"\n[moe mutations, norm_topk_prob={renorm}] killed {total - len(survivors)}/{total}; survivors {survivors}"
        )
    # hf, vllm-cpu(-eager) x 6 (combine has 2 other values); vllm(-eager), sglang x 7 (+ slot sum); vllm-cpu(-eager)
    # store: of nearest/truncate, the one this host's kernels do not use (the other is the same rounding here)
    assert total == 41
    if renorm:  # the softmax over the top k equals the renormalised full softmax: only its fp32 bits differ
        assert all(s.split(":")[1].startswith("router_softmax") for s in survivors), survivors
    else:
        assert survivors == [], survivors


def build_qwen2(seed: int = 0) -> torch.nn.Module:
    """A one-layer tiny Qwen2-MoE (shared expert with its sigmoid gate), weights drawn as in :func:`build`."""
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        hidden_size=H, moe_intermediate_size=INTER, shared_expert_intermediate_size=64, intermediate_size=64,
        num_experts=E, num_experts_per_tok=K, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=128, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=BF)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "gate.weight" in name else 0.1) if p.dim() > 1 else p.normal_(1.0, 0.2)
    return model.eval()


def block_sum_check(model, profile) -> list[str]:
    """Run ``model`` aligned (swiglu, rmsnorm, moe) to ``profile``; the block output against the spec of
    the *unmutated* profile: ``block_sum`` "fp32" = F(R(sigmoid(g)) * shared + routed), "fused" =
    R(sigmoid(x . w_gate) * shared + routed) from the block input (fp32 gate logit), else each op rounded."""
    mlp, rec = model.model.layers[0].mlp, {}
    hooks = [
        mlp.register_forward_pre_hook(lambda m, a: rec.update(x=a[0])),
        mlp.shared_expert.register_forward_hook(lambda m, a, o: rec.update(shared=o)),
        mlp.shared_expert_gate.register_forward_hook(lambda m, a, o: rec.update(g=o)),
        mlp.experts.register_forward_hook(lambda m, a, o: rec.update(routed=o)),
        mlp.register_forward_hook(lambda m, a, o: rec.update(out=o)),
    ]
    try:
        apply_alignment(model, regions=("swiglu", "rmsnorm", "moe"), engine=profile, unverified=("moe",))
        with torch.no_grad():
            model(torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(1)))
    finally:
        for h in hooks:
            h.remove()
        remove_alignment(model)
    d = {k: v.detach().reshape(-1, v.shape[-1]).to(F64) for k, v in rec.items()}
    spec, tolerance = PROFILES[profile.name].moe.block_sum, 0.0
    logit = d["x"] @ mlp.shared_expert_gate.weight.detach().to(F64).t()
    d.setdefault("g", R(logit))  # a "fused" run never calls the gate Linear; its bf16 output for the others
    if spec == "fused":  # the kernel reads the block input and gate row; fp32 vs float64 logit: rare flips
        want, dtype, tolerance = R(torch.sigmoid(logit) * d["shared"] + d["routed"]), BF, TOLERANCE
    elif spec == "fp32":
        sig = R(torch.sigmoid(d["g"]))  # F.sigmoid on bf16: stored in bf16 on both paths
        want, dtype = F(sig * d["shared"] + d["routed"]), torch.float32  # bf16 x bf16 is exact in fp32
    else:
        want, dtype = R(R(R(torch.sigmoid(d["g"])) * d["shared"]) + d["routed"]), BF
    bad = [] if rec["out"].dtype == dtype else ["block/dtype"]
    return bad + (["block/sum"] if mismatch(rec["out"], want) > tolerance else [])


def test_every_block_sum_mutation_is_killed(monkeypatch) -> None:
    model, killed = build_qwen2(), 0
    for name, p in PROFILES.items():
        if p.moe is None:
            continue
        assert block_sum_check(model, p) == [], f"{name}: the original must pass (bit-exact, fused: 0.3%)"
        for other in VALUES["block_sum"]:
            if other != p.moe.block_sum:
                mutant = dataclasses.replace(p, moe=dataclasses.replace(p.moe, block_sum=other))
                assert block_sum_check(model, mutant), f"{name}: block_sum={other} survives"
                killed += 1
    assert killed == 12 and PROFILES["vllm-cpu"].moe.block_sum == "fp32"
    assert PROFILES["sglang"].moe.block_sum == "fused"


def test_hand_on_fp32_block_output_is_exact() -> None:
    """An fp32 MLP output in a bf16 layer: visible R(s) plus the carried remainder is the fp32 sum s exactly."""
    from rlalign_verl.align.regions.residual_stream import Carry, ResidualCarry, hand_on

    g = torch.Generator().manual_seed(3)
    h, r = torch.randn(64, H, generator=g), (torch.randn(64, H, generator=g) * 8).to(BF)
    for carry in (Carry.FP32_SUM, Carry.PAIR):
        box = ResidualCarry()
        visible = hand_on(h, r, carry, box, 0, BF)
        s = h.to(F64) + r.to(F64)
        assert visible.dtype == BF and torch.equal(visible.to(F64), R(s))
        assert torch.equal(visible.to(F64) + box.take_last().to(F64), F(s))
