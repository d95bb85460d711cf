"""The ``tp`` region: row-parallel o_proj/down_proj as a TP engine computes them (no engine here).

References are written from the engines' source, not read from ``profiles.py``: vLLM's ``RowParallelLinear``
splits K into contiguous per-rank slices and each rank's GEMM stores a bf16 partial (bias on rank 0 only);
vLLM's CPU all-reduce (csrc/cpu/shm.cpp ``all_reduce_sum_impl``) and the CUDA custom all-reduce sum the
partials in fp32 from rank 0 and store once; NCCL's ring rounds after every add.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from rlalign_verl import apply_alignment, get_alignment, remove_alignment
from rlalign_verl.align.regions.inductor_norm import stores_sum
from rlalign_verl.align.regions.tp import row_parallel_linear
from rlalign_verl.base.errors import (
    AlignmentError,
    ComputeDtypeError,
    ConfigFormatError,
    UnsupportedModelError,
)
from rlalign_verl.catalog.profiles import PROFILES, get_profile
from rlalign_verl.catalog.profiles_tp import TpReduction, reduction, rollout_tp_line
from rlalign_verl.measure.verify import ladder_rungs
from rlalign_verl.request.spec import AlignmentSpec
from rlalign_verl.tools.diagnose.ladder import plan

BF = torch.bfloat16
FP32_ONCE = TpReduction(accumulate="fp32", order="rank", store="nearest", sizes=(2, 4, 8), beyond="")
BF16_HOPS = TpReduction(accumulate="bf16", order="rank", store="nearest", sizes=(2, 4, 8), beyond="")


def _inputs(seed: int = 0, t: int = 37, k: int = 704, n: int = 256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(BF)
    w = (torch.randn(n, k, generator=g) * 0.05).to(BF)
    b = (torch.randn(n, generator=g) * 0.1).to(BF)
    return x, w, b


def _partials(x, w, b, tp):
    k = w.shape[1] // tp
    return [
        F.linear(x[:, r * k : (r + 1) * k], w[:, r * k : (r + 1) * k], b if r == 0 else None)
        for r in range(tp)
    ]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_fp32_reduction_is_the_partials_summed_once(tp):
    x, w, b = _inputs(tp)
    ref = _sum_in_order(_partials(x, w, b, tp)).to(BF)  # fp32 from rank 0's partial on, one rounding
    got = row_parallel_linear(x, w, b, tp, FP32_ONCE)
    assert got.dtype == BF and torch.equal(got, ref)
    # the single rounding of the unsplit GEMM is not the engine's: the split changes bits
    assert not torch.equal(got, F.linear(x, w, b))


def _sum_in_order(parts):
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc


@pytest.mark.parametrize("tp", [4, 8])
def test_bf16_hops_round_after_every_add(tp):
    x, w, b = _inputs(10 + tp)
    parts = _partials(x, w, b, tp)
    ref = parts[0]
    for p in parts[1:]:
        ref = (ref.float() + p.float()).to(BF)  # NCCL FuncSum<bf16>: __hadd per hop
    got = row_parallel_linear(x, w, b, tp, BF16_HOPS)
    assert torch.equal(got, ref)
    assert not torch.equal(got, row_parallel_linear(x, w, b, tp, FP32_ONCE))  # accumulate is observable


def test_at_tp2_both_accumulations_are_one_add():
    x, w, b = _inputs(3)
    assert torch.equal(row_parallel_linear(x, w, b, 2, FP32_ONCE), row_parallel_linear(x, w, b, 2, BF16_HOPS))


def test_truncating_store_drops_the_low_bits():
    x, w, b = _inputs(4)
    trunc = TpReduction(accumulate="fp32", order="rank", store="truncate", sizes=(2,), beyond="")
    s = _sum_in_order(_partials(x, w, b, 2))
    ref = (
        (s.view(torch.int32) & -65536).view(torch.float32).to(BF)
    )  # BF16Vec16(FP32Vec16) without AVX512-BF16
    assert torch.equal(row_parallel_linear(x, w, b, 2, trunc), ref)


def test_tp1_is_the_plain_linear():
    x, w, b = _inputs(5)
    assert torch.equal(row_parallel_linear(x, w, b, 1, FP32_ONCE), F.linear(x, w, b))


def test_the_gradients_are_the_unsplit_linears():
    """Every partial receives the output's bf16 gradient unchanged, and the slices' gradients are disjoint
    column blocks: the backward is nn.Linear's, bit for bit, for the same upstream gradient."""
    x, w, b = _inputs(6)
    upstream = torch.linspace(-1, 1, w.shape[0])
    grads = []
    for tp in (1, 2, 4):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = row_parallel_linear(xs, ws, bs, tp, FP32_ONCE)
        (y.float() * upstream).sum().backward()
        grads.append((xs.grad, ws.grad, bs.grad))
    for got in grads[1:]:
        for g, ref in zip(got, grads[0], strict=True):
            assert g.dtype == BF and torch.equal(g, ref)


def test_fp32_master_weights_under_bf16_autocast():
    x, w, b = _inputs(7)
    w32, b32 = w.float().requires_grad_(), b.float().requires_grad_()
    with torch.autocast("cpu", dtype=BF):
        y = row_parallel_linear(x, w32, b32, 2, FP32_ONCE)
        ref = row_parallel_linear(x, w, b, 2, FP32_ONCE)
    assert y.dtype == BF and torch.equal(y, ref)  # the GEMMs compute in bf16, as the engine's
    upstream = torch.linspace(-1, 1, w.shape[0])
    (y.float() * upstream).sum().backward()
    w_ref, b_ref = w.float().requires_grad_(), b.float().requires_grad_()
    with torch.autocast("cpu", dtype=BF):
        (F.linear(x, w_ref, b_ref).float() * upstream).sum().backward()  # nn.Linear's backward under autocast
    assert (
        w32.grad.dtype == torch.float32
        and torch.equal(w32.grad, w_ref.grad)
        and torch.equal(b32.grad, b_ref.grad)
    )


def test_an_fp32_computation_is_refused():
    x, w, b = _inputs(8)
    with pytest.raises(ComputeDtypeError, match="mirrors a bf16 engine"):
        row_parallel_linear(x.float(), w.float(), b.float(), 2, FP32_ONCE)


# --- on a model ------------------------------------------------------------------------------------


def _model(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=300, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, dtype=BF)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.08) if p.dim() > 1 else p.normal_(1.0, 0.2)
    return m.eval()


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits


def test_the_tp_region_wraps_o_proj_and_down_proj_only_and_comes_off():
    m = _model()
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(0))
    before = _logits(m, ids)
    keys = {k: v.dtype for k, v in m.state_dict().items()}
    apply_alignment(m, regions=["tp"], engine="vllm-cpu", rollout_tp=2)
    bound = {n.rsplit(".", 1)[-1] for n, mod in m.named_modules() if "forward" in mod.__dict__}
    assert {"o_proj", "down_proj"} <= bound and not {"q_proj", "gate_proj", "up_proj", "lm_head"} & bound
    assert {k: v.dtype for k, v in m.state_dict().items()} == keys
    aligned = _logits(m, ids)
    assert not torch.equal(aligned, before)
    apply_alignment(m, regions=["tp"], engine="vllm-cpu", rollout_tp=2)  # idempotent
    assert torch.equal(_logits(m, ids), aligned)
    restored = pickle.loads(pickle.dumps(m))  # an aligned model pickles aligned
    assert torch.equal(_logits(restored, ids), aligned)
    remove_alignment(m)
    assert torch.equal(_logits(m, ids), before)
    with pytest.raises(
        AlignmentError, match="change nothing at rollout tensor parallel 1"
    ):  # not run as aligned
        apply_alignment(m, regions=["tp"], engine="vllm-cpu", rollout_tp=1)
    assert get_alignment(m) is None
    apply_alignment(m, regions=["rope"], engine="vllm-cpu")
    rope_only = _logits(m, ids)
    remove_alignment(m)
    apply_alignment(
        m, regions=["rope", "tp"], engine="vllm-cpu", rollout_tp=1
    )  # TP=1: the engine's GEMMs are HF's
    assert torch.equal(_logits(m, ids), rope_only)


def test_the_tp_region_trains_under_checkpointing_and_compiles():
    m = _model(1).train()
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
    apply_alignment(m, regions=["rope", "swiglu", "rmsnorm", "tp"], engine="vllm-cpu", rollout_tp=2)
    m(ids).logits.float().logsumexp(-1).mean().backward()
    plain = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m(ids).logits.float().logsumexp(-1).mean().backward()
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, plain[n]), n  # the recompute is the same computation
    m.gradient_checkpointing_disable()
    m.eval()
    compiled = torch.compile(m, backend="eager")
    assert torch.equal(_logits(compiled, ids), _logits(m, ids))


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"engine": "vllm-cpu", "rollout_tp": 3}, AlignmentError, "from TP=3 on the ranks hold different"),
        ({"engine": "hf", "rollout_tp": 2}, AlignmentError, "runs no tensor parallelism"),
        ({"engine": "vllm", "rollout_tp": 16}, AlignmentError, "world sizes 2, 4, 6 and 8"),
        ({"engine": "vllm", "rollout_tp": 3}, AlignmentError, "other sizes go to NCCL"),
        (
            {"engine": "vllm", "rollout_tp": 8},
            UnsupportedModelError,
            "num_attention_heads=4 is not divisible",
        ),
        ({"engine": "vllm-cpu", "rollout_tp": 0}, ConfigFormatError, "rollout_tp=0"),
        ({"engine": "vllm-cpu", "rollout_tp": True}, ConfigFormatError, "rollout_tp=True"),
        ({"engine": "vllm-cpu", "rollout_tp": "two"}, ConfigFormatError, "rollout_tp='two'"),
    ],
)
def test_a_tp_the_data_does_not_describe_is_refused_in_one_line(kwargs, error, fragment):
    m = _model()
    with pytest.raises(error, match=fragment) as info:
        apply_alignment(m, regions=["tp"], **kwargs)
    assert "\n" not in str(info.value)
    assert "forward" not in m.model.layers[0].self_attn.o_proj.__dict__


def test_lora_wrapped_projections_are_refused_not_dropped():
    """A PEFT LoRA layer at o_proj/down_proj computes base + adapter; splitting its base weight alone would drop the
    adapter without a word."""
    peft = pytest.importorskip("peft")
    m = peft.get_peft_model(_model(), peft.LoraConfig(r=4, target_modules=["o_proj", "down_proj"]))
    with pytest.raises(UnsupportedModelError, match="LoRA adapters .* merge the adapters") as info:
        apply_alignment(m, regions=["rope", "tp"], engine="vllm-cpu", rollout_tp=2)
    assert "\n" not in str(info.value)
    assert not [n for n, mod in m.named_modules() if "forward" in mod.__dict__]  # nothing was bound


def test_tp_on_moe_models_checks_every_split_width():
    """Routed experts split (tests/align/test_tp_moe.py), a shared expert too; each width must divide."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    from rlalign_verl.request.checks import validate_request

    spec = AlignmentSpec.parse(regions="tp", engine="vllm-cpu", rollout_tp=2)
    validate_request(spec, model_type="qwen3_moe", model_config=Qwen3MoeConfig())
    validate_request(spec, model_type="qwen2_moe", model_config=Qwen2MoeConfig())
    odd = Qwen2MoeConfig(shared_expert_intermediate_size=5631)
    with pytest.raises(UnsupportedModelError, match="shared_expert_intermediate_size=5631 is not divisible"):
        validate_request(spec, model_type="qwen2_moe", model_config=odd)


def test_a_hand_set_rollout_tp_is_refused_on_the_driver_surfaces():
    from rlalign_verl.request.spec import refuse_resolved_keys

    for spelling, key in (("hydra", "alignment.rollout_tp"), ("flag", "--alignment.rollout_tp")):
        with pytest.raises(
            ConfigFormatError, match=f"{key} is set by the driver from .*tensor_model_parallel_size"
        ):
            refuse_resolved_keys({"regions": ["tp"], "rollout_tp": 4}, spelling)
    refuse_resolved_keys({"regions": ["tp"]}, "hydra")  # what users write passes


def test_rollout_tp_travels_in_the_request():
    spec = AlignmentSpec.parse(regions="all,tp", engine="vllm-cpu", rollout_tp=2)
    assert spec.regions == ("rope", "swiglu", "rmsnorm", "tp") and spec.rollout_tp == 2
    assert AlignmentSpec.from_json(spec.to_json()) == spec
    assert AlignmentSpec.parse({"regions": ["rope"]}).rollout_tp == 1  # a missing size is TP=1
    assert "rollout_tp=2" in spec.describe()
    assert "tp" not in AlignmentSpec.parse(regions="all").regions  # opt-in: never part of all


def test_every_profile_that_rolls_out_with_tp_says_how_it_reduces():
    for p in PROFILES.values():
        assert (reduction(p) is None) == (p.engine == "hf"), p.name
        if reduction(p) is not None:
            assert reduction(p).sources and reduction(p).beyond, p.name
    # one communicator per engine and device: an engine's compiled and eager paths reduce alike
    assert reduction(get_profile("vllm-cpu")) is reduction(get_profile("vllm-cpu-eager"))
    assert reduction(get_profile("vllm")) is reduction(get_profile("vllm-eager"))
    assert reduction(get_profile("sglang")) is not reduction(get_profile("vllm"))
    cpu = reduction(get_profile("vllm-cpu"))
    assert cpu.verified_tp == (2,) and cpu.store == "vllm-cpu-allreduce"
    assert all(
        reduction(get_profile(n)).verified_tp == () for n in ("vllm", "vllm-eager", "sglang")
    )  # unverified
    # a user's variant of a profile keeps its engine's reduction
    assert reduction(get_profile("vllm-cpu").with_name("mine")) is cpu


def test_the_compiled_graph_stores_the_stream_one_norm_later_at_tp_gt_1():
    # at TP>1 the embedding is an all-reduce output (one buffer read), not a gather (ids + table)
    assert [n for n in range(17) if stores_sum(n)] == [3, 7, 11, 15]
    assert [n for n in range(17) if stores_sum(n, tp=2)] == [4, 8, 12, 16]


def test_the_ladder_has_a_tp_rung_for_tp_rollouts():
    def tp_step(profile, tp, moe=False):
        return next(s for s in plan(get_profile(profile), "model", moe, tp) if s[0].name == "+ tp")

    assert "tensor parallel 1" in tp_step("vllm-cpu", 1)[3]
    rung, regions, _, why = tp_step("vllm-cpu", 2)
    assert why is None and "tp" in regions and "attention" in regions
    assert "different hidden states" in tp_step("vllm-cpu", 4)[3]
    assert tp_step("vllm-cpu", 2, moe=True)[3] is None  # routed and shared experts split
    assert tp_step("vllm", 4)[3] is None  # CUDA data: measured (and judged) where it runs


def test_verify_ladder_and_doctor_name_tp():
    spec = AlignmentSpec.parse(regions="all,tp", engine="vllm-cpu", rollout_tp=2)
    assert ladder_rungs(spec) == ["none", "rope", "swiglu", "rmsnorm", "tp"]
    assert ladder_rungs(spec.replace(rollout_tp=1)) == [
        "none",
        "rope",
        "swiglu",
        "rmsnorm",
    ]  # tp alone = none
    line = rollout_tp_line(2, ("rope", "swiglu", "rmsnorm"))
    assert line and "tensor parallel 2" in line and "add tp to alignment.regions" in line and "\n" not in line
    assert rollout_tp_line(2, spec.regions) is None and rollout_tp_line(1, ("rope",)) is None
    assert rollout_tp_line(4, ()) is None  # alignment off: nothing to add to
    from rlalign_verl.catalog.profiles_tp import tp_unmodelled_line

    cuda = tp_unmodelled_line(get_profile("vllm"), 4, ("tp",))
    assert cuda and "AllReduceFusionPass" in cuda and "UNVERIFIED at TP=4" in cuda and "\n" not in cuda
    assert tp_unmodelled_line(get_profile("vllm-cpu"), 2, ("tp",)) is None  # nothing left out, verified
    assert tp_unmodelled_line(get_profile("vllm"), 1, ("tp",)) is None


@pytest.mark.parametrize("profile", ["vllm", "vllm-eager", "sglang"])
def test_the_gpu_profiles_reduce_as_their_custom_all_reduce(profile):
    """Source facts (../shared/docs/tp-reduction.md): vLLM's custom all-reduce (custom_collective_common.cuh:83-88,
    292-299) and SGLang's CustomAllReduceV2 (vec.cuh:138-160) accumulate in fp32 over ranks 0..N-1 and round once,
    to nearest; both run up to 8 ranks."""
    x, w, b = _inputs(20)
    ref = _sum_in_order(_partials(x, w, b, 4)).to(BF)
    assert torch.equal(row_parallel_linear(x, w, b, 4, reduction(get_profile(profile))), ref)
    assert reduction(get_profile(profile)).sizes == (2, 4, 6, 8)


def test_rlalign_verl_profiles_says_how_each_profile_reduces(capsys):
    from rlalign_verl.tools.cli import main

    assert main(["profiles"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "rollout TP > 1 (the tp region)" in ln]
    assert len(lines) == len(PROFILES)
    assert sum("verified at TP 2" in ln for ln in lines) == 2 and sum("UNVERIFIED" in ln for ln in lines) == 3
