"""The tp region on MoE models: the routed experts as the engine's tensor-parallel ranks compute them.

Source facts written here (vLLM 0.31.0, read from its code, not from rlalign_verl):
- ``FusedMoE`` without expert parallel gives rank ``r`` every expert's intermediate columns ``r*I/N .. (r+1)*I/N``:
  its ``w13`` holds the gate rows of that slice, then the up rows of the same slice (``_load_w13`` narrows each
  checkpoint tensor by ``tp_rank``); its ``w2`` holds the same columns of ``down``.
- each rank runs the experts and the combine on its slice (``cpu_fused_moe`` on CPU: a bf16 output), and the late
  all-reduce (``moe_runner._maybe_reduce_final_output``) sums the ranks' bf16 outputs; vLLM CPU's shm all-reduce at
  2 ranks is one fp32 add and one conversion (nearest with AVX512-BF16; truncation with AVX512F alone; AVX2: gloo's
  bf16 add, nearest).
- Qwen2-MoE's shared expert (``Qwen2MoeMLP`` with ``reduce_results=False``): rank ``r`` computes its down_proj over
  its K slice (a bf16 partial, no all-reduce of its own), ``F.sigmoid(expert_gate(x)) * out`` on it
  (``Qwen2MoeMLP.forward``), then ``shared_output + fused_output`` with its routed partial
  (``MoERunner.forward``), and the one late all-reduce sums the ranks' sums. Eager every op stores bf16; compiled,
  the [T, 1] sigmoid is stored and Inductor fuses product and sum into one bf16 store (the all-reduce's input).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_engine_reference import MODES, inputs, route, vllm_reference
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from rlalign_verl.align.engine_ops.moe_op import engine_experts, engine_op_available
from rlalign_verl.align.patch import apply_alignment, get_alignment, remove_alignment
from rlalign_verl.align.regions.moe import mix_experts
from rlalign_verl.align.regions.tp import split_experts
from rlalign_verl.base.errors import AlignmentError, UnsupportedModelError
from rlalign_verl.catalog import profiles_tp
from rlalign_verl.catalog.profiles import get_profile
from rlalign_verl.catalog.profiles_tp import TpReduction
from rlalign_verl.request.checks import validate_request
from rlalign_verl.request.spec import AlignmentSpec

BF = torch.bfloat16
FP32_SUM = TpReduction(accumulate="fp32", order="rank", store="nearest", sizes=(2, 4), beyond="-")


def _host_allreduce_store() -> str:
    """vLLM CPU's all-reduce store on this host (the source facts above), for the engine's ranks."""
    if torch.cpu._is_avx512_supported() and not torch.cpu._is_avx512_bf16_supported():
        return "truncate"
    return "nearest"


def _to_bf16(x: torch.Tensor, store: str) -> torch.Tensor:
    if store == "truncate":
        return (x.contiguous().view(torch.int32) & -65536).view(torch.float32).to(BF)
    return x.to(BF)


def _rank_weights(gate_up: torch.Tensor, down: torch.Tensor, r: int, tp: int):
    """Rank ``r``'s ``w13`` and ``w2`` as vLLM's weight loader fills them (written here, not imported)."""
    inter = down.shape[-1]
    k = inter // tp
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    return torch.cat((gate[:, r * k : (r + 1) * k], up[:, r * k : (r + 1) * k]), 1), down[
        :, :, r * k : (r + 1) * k
    ]


engine = pytest.mark.skipif(
    not engine_op_available()[0], reason="vLLM's CPU build (cpu_fused_moe) is not installed"
)


@engine
@pytest.mark.parametrize("profile", list(MODES))
@pytest.mark.parametrize("inter", [256, 160], ids=["inter256", "inter160-padded-per-rank"])
def test_engine_op_experts_at_tp2_are_the_engine_ranks_bit_for_bit(profile: str, inter: int) -> None:
    x, gate_up, down, logits = inputs(inter, 64, 128, inter, 8)
    weights, w_eng, ids = route(logits, 2, profile)
    store = _host_allreduce_store()
    parts = [vllm_reference(x, *_rank_weights(gate_up, down, r, 2), w_eng, ids) for r in range(2)]
    want = _to_bf16(parts[0].float() + parts[1].float(), store)  # one fp32 add, one conversion
    rounding, reduction = get_profile(profile).moe, profiles_tp.reduction(get_profile(profile))
    got = split_experts(x, ids.long(), weights, gate_up, down, rounding, mix=engine_experts, tp=2,
                        reduction=reduction, store=store)  # fmt: skip
    assert got.dtype == BF and torch.equal(got, want)
    unsplit = engine_experts(x, ids.long(), weights, gate_up, down, rounding)
    assert float((unsplit == want).double().mean()) < 0.95  # the split is observable: the comparison can fail


@pytest.mark.parametrize("tp", [2, 4])
def test_emulated_experts_split_over_the_ranks_and_reduce_once(tp: int) -> None:
    x, gate_up, down, logits = inputs(tp, 48, 64, 128, 6)
    ids = torch.topk(logits.float(), 2, dim=-1).indices
    weights = torch.softmax(torch.gather(logits.float(), 1, ids), -1)
    rounding = get_profile("vllm-cpu").moe
    parts = [mix_experts(x, ids, weights, *_rank_weights(gate_up, down, r, tp), rounding) for r in range(tp)]
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    got = split_experts(x, ids, weights, gate_up, down, rounding, mix=mix_experts, tp=tp, reduction=FP32_SUM,
                        store="nearest")  # fmt: skip
    assert torch.equal(got, acc.to(BF))
    # gate and up of one rank come from the same columns: swapping the halves' order is another result
    swapped = torch.cat((gate_up[:, 128:], gate_up[:, :128]), 1)
    assert not torch.equal(
        split_experts(x, ids, weights, swapped, down, rounding, mix=mix_experts, tp=tp, reduction=FP32_SUM,
                      store="nearest"), got)  # fmt: skip


def test_gradients_through_the_split_match_the_unsplit_ones() -> None:
    """The split changes where the forward rounds, not the math: gradients agree within bf16 rounding (each is a
    bf16 result of fp32 sums over the same terms; 2^-7 relative, times a few for the accumulated roundings)."""
    x, gate_up, down, logits = inputs(11, 40, 64, 128, 6)
    ids = torch.topk(logits.float(), 2, dim=-1).indices
    weights = torch.softmax(torch.gather(logits.float(), 1, ids), -1).to(BF)
    rounding = get_profile("vllm-cpu").moe
    g_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(BF)
    grads = []
    for split in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
        xx, ww, gu, dd = leaves
        if split:
            y = split_experts(
                xx, ids, ww, gu, dd, rounding, mix=mix_experts, tp=2, reduction=FP32_SUM, store="nearest"
            )
        else:
            y = mix_experts(xx, ids, ww, gu, dd, rounding)
        y.backward(g_out)
        grads.append([t.grad.float() for t in leaves])
    for a, b in zip(*grads, strict=True):
        assert torch.isfinite(a).all()
        assert (a - b).abs().max() <= 0.04 * b.abs().max(), float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("tp", [2, 4])
def test_recomputed_ranks_give_autograds_gradients(tp: int) -> None:
    """The ranks' experts are recomputed in backward, one rank at a time (nothing of theirs kept from forward): the
    forward is unchanged bit for bit; each gradient is every rank's own autograd gradient summed in fp32 and rounded
    once, bit for bit; autograd through all ranks at once rounds after each add instead (measured: x's gradient
    72% / 48% identical at TP 2 / 4, within 0.5% of the largest; the weights' identical: one rank each)."""
    from rlalign_verl.align.regions.tp import reduce_partials

    x, gate_up, down, logits = inputs(13, 40, 64, 128, 6)
    ids = torch.topk(logits.float(), 2, dim=-1).indices
    weights = torch.softmax(torch.gather(logits.float(), 1, ids), -1).to(BF)
    rounding = get_profile("vllm-cpu").moe
    g_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(BF)

    def run(recomputed: bool):
        leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
        xx, ww, gu, dd = leaves
        if recomputed:
            y = split_experts(xx, ids, ww, gu, dd, rounding, mix=mix_experts, tp=tp, reduction=FP32_SUM,
                              store="nearest")  # fmt: skip
        else:
            y = reduce_partials([mix_experts(xx, ids, ww, gu, dd, rounding, rank=(r, tp)) for r in range(tp)],
                                FP32_SUM, "nearest")  # fmt: skip
        y.backward(g_out)  # each part's gradient is g_out: the fp32 sum passes bf16 gradients unchanged
        return y.detach(), [t.grad for t in leaves]

    (y_re, got), (y_ag, autograd) = run(True), run(False)
    assert torch.equal(y_re, y_ag)
    per_rank = []
    for r in range(tp):
        leaves = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
        mix_experts(leaves[0], ids, *leaves[1:], rounding, rank=(r, tp)).backward(g_out)
        per_rank.append([t.grad.float() for t in leaves])
    want = [sum(gs[1:], gs[0]).to(BF) for gs in zip(*per_rank, strict=True)]
    for g_re, g_want, g_ag in zip(got, want, autograd, strict=True):
        assert torch.equal(g_re, g_want)
        assert float((g_re.float() - g_ag.float()).abs().max()) <= 2**-7 * float(g_ag.float().abs().max())


def _moe_model(kind: str) -> torch.nn.Module:
    common = dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    cfg = Qwen3MoeConfig(head_dim=16, **common) if kind == "qwen3_moe" else Qwen2MoeConfig(
        shared_expert_intermediate_size=64, **common)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=BF)


def test_the_tp_region_splits_a_qwen3_moe_models_experts_and_comes_off() -> None:
    m = _moe_model("qwen3_moe")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = m(ids).logits
    apply_alignment(m, regions=["rope", "swiglu", "rmsnorm", "moe", "tp"], engine="vllm-cpu", rollout_tp=2)
    experts = m.model.layers[0].mlp.experts
    o_proj = m.model.layers[0].self_attn.o_proj
    assert "forward" in experts.__dict__ and "forward" in o_proj.__dict__
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(BF)
    top = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]])
    w = torch.full((5, 2), 0.5, dtype=torch.float32)
    store = _host_allreduce_store()
    parts = [mix_experts(x, top, w, *_rank_weights(experts.gate_up_proj, experts.down_proj, r, 2),
                         get_profile("vllm-cpu").moe) for r in range(2)]  # fmt: skip
    with torch.no_grad():
        assert torch.equal(experts(x, top, w), _to_bf16(parts[0].float() + parts[1].float(), store))
    remove_alignment(m)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, before)
    # tp alone splits HF's experts (bound too): the rung the step-1 ladder measures
    apply_alignment(m, regions=["rope", "tp"], engine="vllm-cpu", rollout_tp=2)
    assert "forward" in m.model.layers[0].mlp.experts.__dict__ and get_alignment(m).regions == ("rope", "tp")


def _shared_block_reference(block: torch.nn.Module, x: torch.Tensor, rounding, fused: bool, store: str):
    """The source facts above, written here: each rank's gated shared partial plus its routed partial, one
    all-reduce. The shared expert's SwiGLU output is taken from its own (aligned) forward."""
    seen = []
    sh = block.shared_expert
    hook = sh.down_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        sh(x)
        hook.remove()
        _, w, top = block.gate(x)
        h, wd, e = seen[0], sh.down_proj.weight, block.experts
        k = wd.shape[1] // 2
        gate = torch.sigmoid(torch.nn.functional.linear(x, block.shared_expert_gate.weight))  # bf16 [T, 1]
        total = torch.zeros(x.shape)
        for r in range(2):
            shared = torch.nn.functional.linear(h[:, r * k : (r + 1) * k], wd[:, r * k : (r + 1) * k])  # bf16
            routed = mix_experts(x, top, w, *_rank_weights(e.gate_up_proj, e.down_proj, r, 2), rounding)
            if fused:  # compiled: product and sum in fp32, one store
                rank = (gate.float() * shared.float() + routed.float()).to(BF)
            else:  # eager: F.sigmoid(gate) * out stores, shared_output + fused_output stores
                rank = gate * shared + routed
            total = total + rank.float()
        return _to_bf16(total, store)


@pytest.mark.parametrize("profile, fused", [("vllm-cpu-eager", False), ("vllm-cpu", True)])
def test_a_shared_experts_rank_partials_join_the_routed_ones_before_one_all_reduce(profile: str, fused: bool):
    m = _moe_model("qwen2_moe")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = m(ids).logits
    regions = ["rope", "swiglu", "rmsnorm", "moe", "tp"]
    apply_alignment(m, regions=regions, engine=profile, rollout_tp=2)
    block = m.model.layers[0].mlp
    assert "forward" in block.__dict__ and "forward" in m.model.layers[0].self_attn.o_proj.__dict__
    # its all-reduce is the block's: the shared expert's down_proj is not reduced on its own
    assert "forward" not in block.shared_expert.down_proj.__dict__
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)).to(BF)
    rounding = dataclasses.replace(get_profile(profile).moe, block_sum="bf16")  # the experts' own rounding
    store = _host_allreduce_store()
    with torch.no_grad():
        got = block(x)
    assert got.dtype == BF and torch.equal(got, _shared_block_reference(block, x, rounding, fused, store))
    # the other path's rank sum is another result: the comparison can fail
    assert not torch.equal(got, _shared_block_reference(block, x, rounding, not fused, store))
    remove_alignment(m)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, before)


def test_gradients_through_a_split_shared_expert_block_match_the_unsplit_ones() -> None:
    """As for the routed experts: the split moves roundings, not the math (bf16 tolerance, as above)."""
    grads = []
    for tp in (2, None):
        m = _moe_model("qwen2_moe")
        if tp:
            apply_alignment(m, regions=["rope", "tp"], engine="vllm-cpu", rollout_tp=tp)
        block = m.model.layers[0].mlp
        x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(3)).to(BF).requires_grad_()
        block(x).float().square().sum().backward()
        sh = block.shared_expert
        grads.append(
            [x.grad, sh.down_proj.weight.grad, sh.gate_proj.weight.grad, block.experts.down_proj.grad]
        )
    for a, b in zip(*grads, strict=True):
        a, b = a.float(), b.float()
        assert torch.isfinite(a).all() and b.abs().max() > 0
        assert (a - b).abs().max() <= 0.04 * b.abs().max(), float((a - b).abs().max() / b.abs().max())


@pytest.mark.slow
def test_a_split_qwen2_moe_trains_under_checkpointing_and_compiles() -> None:
    m = _moe_model("qwen2_moe").train()
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(4))
    apply_alignment(m, regions=["rope", "swiglu", "rmsnorm", "moe", "tp"], engine="vllm-cpu", rollout_tp=2)
    m(ids).logits.float().logsumexp(-1).mean().backward()
    plain = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert plain["model.layers.0.mlp.shared_expert.down_proj.weight"].abs().max() > 0
    m.zero_grad()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m(ids).logits.float().logsumexp(-1).mean().backward()
    for n, g in plain.items():
        assert torch.equal(m.get_parameter(n).grad, g), n  # the recompute is the same computation
    m.gradient_checkpointing_disable()
    m.eval()
    with torch.no_grad():
        assert torch.equal(torch.compile(m, backend="eager")(ids).logits, m(ids).logits)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_a_split_moe_model_generates_with_the_kv_cache(kind: str) -> None:
    """The KV cache keeps working with the experts (and Qwen2-MoE's shared expert) split by rank: greedy generation
    with the cache gives the tokens generation without it gives."""
    m = _moe_model(kind).eval()
    apply_alignment(m, regions=["rope", "swiglu", "rmsnorm", "moe", "tp"], engine="vllm-cpu", rollout_tp=2)
    prompt = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cached = m.generate(prompt, max_new_tokens=6, do_sample=False)
        uncached = m.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.shape[1] == 13 and torch.equal(cached, uncached)


@pytest.mark.parametrize("target", ["shared_expert.down_proj", "shared_expert_gate"])
def test_an_adapter_on_the_shared_experts_reduced_layers_is_refused_before_binding(target: str) -> None:
    peft = pytest.importorskip("peft")
    m = peft.get_peft_model(_moe_model("qwen2_moe"), peft.LoraConfig(r=4, target_modules=[target]))
    with pytest.raises(UnsupportedModelError, match=f"{target.split('.')[-1]} as a plain nn.Linear") as info:
        apply_alignment(m, regions=["rope", "tp"], engine="vllm-cpu", rollout_tp=2)
    assert "\n" not in str(info.value)
    assert not [n for n, mod in m.named_modules() if "forward" in mod.__dict__]  # nothing was bound


def test_moe_at_rollout_tp_needs_tp() -> None:
    m = _moe_model("qwen3_moe")
    with pytest.raises(AlignmentError, match="add tp to the regions"):
        apply_alignment(m, regions=["rope", "swiglu", "rmsnorm", "moe"], engine="vllm-cpu", rollout_tp=2)
    assert get_alignment(m) is None
    spec = AlignmentSpec.parse(regions=["rope", "tp"], engine="vllm", rollout_tp=4, spelling="python")
    odd = Qwen3MoeConfig(num_attention_heads=4, intermediate_size=96, moe_intermediate_size=66, num_experts=4)
    with pytest.raises(UnsupportedModelError, match="moe_intermediate_size=66 is not divisible"):
        validate_request(spec, model_type="qwen3_moe", model_config=odd)
    few = Qwen3MoeConfig(num_attention_heads=4, intermediate_size=96, moe_intermediate_size=64, num_experts=2)
    with pytest.raises(UnsupportedModelError, match="2 experts over rollout tensor parallel 4"):
        validate_request(spec, model_type="qwen3_moe", model_config=few)
