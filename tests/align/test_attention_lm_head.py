"""The opt-in ``attention`` and ``lm_head`` regions: numbers vs fp64 references, gradients, bad inputs.

Shapes here (head_dim 64, 3 query / 1 kv heads, hidden 160, vocab 288) are used by no other test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from rlalign_verl.align.engine_ops import attention_op as E
from rlalign_verl.align.patch import apply_alignment, get_alignment, remove_alignment
from rlalign_verl.align.regions import attention as A
from rlalign_verl.align.regions.lm_head import Fp32HeadFn
from rlalign_verl.base.errors import ConfigFormatError, UnknownRegionError
from rlalign_verl.request.checks import AttentionUnsupportedError
from rlalign_verl.request.regions import REGIONS, normalize_regions

BF = torch.bfloat16
HQ, HKV, D = 3, 1, 64
engine_op = pytest.mark.skipif(
    not E.engine_op_available()[0], reason="vLLM's CPU attention op is not installed"
)


def _qkv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, D, generator=g).to(BF) for h in (HQ, HKV, HKV))


def _ref_fp64(q, k, v, lens, scale):
    """Causal attention per sequence in fp64 from the packed bf16 inputs (kv heads repeated)."""
    out = []
    for sq, sk, sv in zip(q.split(lens), k.split(lens), v.split(lens), strict=True):
        qq = sq.double().transpose(0, 1)
        kk, vv = (x.double().transpose(0, 1).repeat_interleave(HQ // HKV, 0) for x in (sk, sv))
        n = sq.shape[0]
        s = (qq @ kk.transpose(-1, -2)) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out.append((s.softmax(-1) @ vv).transpose(0, 1))
    return torch.cat(out)


def test_region_names() -> None:
    assert normalize_regions("all") == REGIONS  # opt-in regions are not in "all"
    assert normalize_regions("all,lm_head") == (*REGIONS, "lm_head")
    assert normalize_regions("lm_head,attention,rope") == ("rope", "attention", "lm_head")
    with pytest.raises(UnknownRegionError, match="valid regions"):
        normalize_regions("rope,atention")


@pytest.mark.parametrize("profile", ["vllm", "vllm-eager", "sglang"])
def test_attention_refused_on_gpu_profiles(profile: str) -> None:
    model = _model("qwen2")
    with pytest.raises(AttentionUnsupportedError) as e:
        apply_alignment(model, regions="rope,attention", engine=profile)
    msg = str(e.value)
    assert "\n" not in msg and "drop 'attention'" in msg and ("FlashAttention" in msg or "FlashInfer" in msg)
    assert get_alignment(model) is None


def test_unknown_attention_variant_and_head_dtype() -> None:
    with pytest.raises(ConfigFormatError, match="sdpa-fp32"):
        apply_alignment(_model("qwen2"), regions="attention", engine="vllm-cpu", attention="flash")
    with pytest.raises(ConfigFormatError, match="float32"):
        apply_alignment(_model("qwen2"), regions="lm_head", engine="vllm-cpu", head_dtype="float16")


def test_sequence_ids_from_positions() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 0, 0, 1, 2]])  # packed pair; left padding
    ids = A.sequence_ids(pos, 2, 5)
    assert ids.tolist() == [0, 0, 0, 1, 1, 2, 3, 4, 4, 4]
    assert A.sequence_ids(None, 2, 3).tolist() == [0, 0, 0, 1, 1, 1]


def test_sdpa_fp32_rounds_once() -> None:
    q, k, v = _qkv(200)
    lens, scale = [120, 1, 79], 0.125
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    out = A.AttentionFn.apply(q, k, v, ids, scale, None)  # no engine kernel: the sdpa-fp32 variant
    ref = _ref_fp64(q, k, v, lens, scale).to(BF)
    hf_bf16 = torch.cat([  # HF's bf16 SDPA, the path the region replaces
        F.scaled_dot_product_attention(a.transpose(0, 1)[None], b.transpose(0, 1)[None].repeat_interleave(3, 1),
                                       c.transpose(0, 1)[None].repeat_interleave(3, 1), is_causal=True, scale=scale)[0]
        .transpose(0, 1) for a, b, c in zip(q.split(lens), k.split(lens), v.split(lens), strict=True)
    ])  # fmt: skip
    exact = (out == ref).float().mean().item()
    assert exact > 0.999, exact
    assert (hf_bf16 == ref).float().mean().item() < exact - 0.05


@pytest.mark.slow
@engine_op
def test_engine_op_prefill_equals_decode_and_batching() -> None:
    """The engine computes decode tokens one at a time; a full-sequence prefill must give the same bits."""
    q, k, v = _qkv(150, seed=1)
    one = torch.zeros(150, dtype=torch.long)
    full = E.engine_attention(q, k, v, one, 0.125)
    for t in (0, 1, 63, 127, 128, 149):  # block boundaries of the 128-token paged cache
        dec = E.engine_attention(q[: t + 1], k[: t + 1], v[: t + 1], one[: t + 1], 0.125)[-1]
        assert torch.equal(dec, full[t]), t
    q2, k2, v2 = _qkv(40, seed=2)
    ids = torch.cat([torch.zeros(40, dtype=torch.long), torch.ones(150, dtype=torch.long)])
    batched = E.engine_attention(torch.cat([q2, q]), torch.cat([k2, k]), torch.cat([v2, v]), ids, 0.125)
    assert torch.equal(batched[40:], full)
    ref = _ref_fp64(q, k, v, [150], 0.125)
    assert (full.double() - ref).abs().max().item() <= 2 * 2.0**-8 * ref.abs().max().item()


@pytest.mark.parametrize("variant", ["sdpa-fp32", pytest.param("engine-op", marks=engine_op)])
def test_attention_backward_is_fp32_sdpa(variant: str) -> None:
    b, t = 2, 70
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, h, t, D, generator=g).to(BF).requires_grad_() for h in (HQ, HKV, HKV))
    pos = torch.cat([torch.arange(t)[None], torch.cat([torch.arange(30), torch.arange(40)])[None]])
    out = A.aligned_attention(q, k, v, pos, None, E.engine_attention if variant == "engine-op" else None)
    w = torch.randn(out.shape, generator=g)
    (out.float() * w).sum().backward()
    # reference: fp64 autograd, per sequence
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    refs = []
    for row, segs in ((0, [(0, t)]), (1, [(0, 30), (30, t)])):
        for s, e in segs:
            kk, vv = (x[row, :, s:e].repeat_interleave(HQ // HKV, 0) for x in (kd, vd))
            o = F.scaled_dot_product_attention(qd[row, :, s:e][None], kk[None], vv[None], is_causal=True)[0]
            refs.append((row, s, e, o))
    loss = sum((o.transpose(0, 1) * w[row, s:e].double()).sum() for row, s, e, o in refs)
    loss.backward()
    for ours, ref in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        err = (ours.double() - ref).abs().max().item()
        assert err <= 2.0**-7 * ref.abs().max().item(), err


def _model(arch: str, tie: bool = False) -> torch.nn.Module:
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    cfg = cls(hidden_size=160, intermediate_size=352, num_hidden_layers=2, num_attention_heads=HQ,
              num_key_value_heads=HKV, head_dim=D, vocab_size=288, tie_word_embeddings=tie,
              attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=BF)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.08) if p.dim() > 1 else p.normal_(1.0, 0.2)
    return m.eval()


def test_fp32_head_logits_and_grads() -> None:
    g = torch.Generator().manual_seed(4)
    h = torch.randn(5, 7, 160, generator=g).to(BF).requires_grad_()
    w = (torch.randn(288, 160, generator=g) * 0.1).to(BF).requires_grad_()
    out = Fp32HeadFn.apply(h, w, None, False)
    assert out.dtype == torch.float32
    # vLLM's cast path (LogitsProcessor._apply_head off CUDA): F.linear on fp32 casts, bit for bit
    assert torch.equal(out, F.linear(h.detach().float(), w.detach().float()))
    gy = torch.randn(out.shape, generator=g)
    (out * gy).sum().backward()
    hd, wd = h.detach().double(), w.detach().double()
    assert torch.allclose(h.grad.double(), (gy.double() @ wd), rtol=2**-7, atol=1e-3)
    assert torch.allclose(
        w.grad.double(), gy.double().reshape(-1, 288).t() @ hd.reshape(-1, 160), rtol=2**-7, atol=1e-2
    )


@pytest.mark.parametrize("tie", [False, True])
def test_lm_head_region_on_model(tie: bool) -> None:
    model = _model("qwen2", tie)
    ids = torch.randint(0, 288, (2, 24), generator=torch.Generator().manual_seed(5))
    base = model(input_ids=ids).logits
    apply_alignment(model, regions="rope,lm_head", engine="vllm-cpu-eager")
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    w = model.lm_head.weight
    assert not any(t.dtype == torch.float32 and t.shape == w.shape for t in saved)  # no fp32 weight copy kept
    logits.float().sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad.float()).all()
    # the hidden states feeding the head are the rope-aligned model's; the head itself is the fp32 GEMM
    assert (logits.to(BF) == base).float().mean() < 1.0
    remove_alignment(model)
    assert torch.equal(model(input_ids=ids).logits, base)
    apply_alignment(model, regions="lm_head", engine="vllm-cpu-eager", head_dtype="model")
    assert torch.equal(model(input_ids=ids).logits, base)  # engine bf16 head = HF's head


@pytest.mark.parametrize("variant", ["sdpa-fp32", pytest.param("engine-op", marks=engine_op)])
def test_attention_region_on_model(variant: str) -> None:
    model = _model("qwen3")
    ids = torch.randint(0, 288, (1, 40), generator=torch.Generator().manual_seed(6))
    ref = model(input_ids=ids).logits
    apply_alignment(model, regions="rope,swiglu,rmsnorm", engine="vllm-cpu-eager")
    three = model(input_ids=ids).logits
    apply_alignment(
        model, regions="rope,swiglu,rmsnorm,attention", engine="vllm-cpu-eager", attention=variant
    )
    assert get_alignment(model).attention_variant == variant
    out = model(input_ids=ids).logits
    assert not torch.equal(out, three)
    # a packed batch of the same sequence twice (position_ids restart) gives each copy the same logits
    packed = torch.cat([ids, ids], 1)
    pos = torch.cat([torch.arange(40), torch.arange(40)])[None]
    two = model(input_ids=packed, position_ids=pos).logits
    assert torch.equal(two[:, :40], out) and torch.equal(two[:, 40:], out)
    out.float().sum().backward()
    assert all(p.grad is None or torch.isfinite(p.grad.float()).all() for p in model.parameters())
    remove_alignment(model)
    assert torch.equal(model(input_ids=ids).logits, ref)


@pytest.mark.parametrize(
    "regions,match", [("rope,lm_head", "head_dtype"), ("rope,attention", "FlashAttention")]
)
def test_openrlhf_refuses_opt_in_regions_it_cannot_align(regions: str, match: str) -> None:
    from rlalign_verl.base.errors import AlignmentError
    from rlalign_verl.openrlhf.settings import parse_launcher_args

    with pytest.raises(AlignmentError, match=match) as e:
        parse_launcher_args(["--alignment.regions", regions, "--alignment.engine", "vllm"])
    assert "\n" not in str(e.value)
