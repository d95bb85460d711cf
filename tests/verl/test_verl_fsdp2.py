"""FSDP2 ``cast_forward_inputs`` must not change an aligned model (CPU, gloo, one process).

verl wraps every decoder layer and the root with ``fully_shard(mp_policy=MixedPrecisionPolicy(bf16,
fp32, cast_forward_inputs=True))``, which casts every floating input of a wrapped layer to bf16. The
``vllm`` and ``vllm-cpu`` profiles carry the residual across a decoder-layer boundary in fp32; a layer
returns the bf16 ``R(s)`` and the fp32 remainder travels in a carry object (a keyword argument the cast
does not enter), so nothing is rounded. Expected tolerance: bit-identical logits.

Runs in a fresh process (``python test_verl_fsdp2.py child <path>``) so the process group does not
leak into other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gloo_fsdp import child_env

pytestmark = pytest.mark.slow  # the edit-loop tier leaves it out (pyproject markers)

PROFILES = ("vllm", "vllm-cpu", None)  # None: unaligned baseline


@pytest.fixture
def tiny_paths(tiny_checkpoint) -> dict[str, str]:
    return {arch: str(tiny_checkpoint(arch)) for arch in ("qwen2", "qwen3")}


def test_fsdp2_cast_forward_inputs_keeps_aligned_logits_bit_identical(tiny_paths):
    env = child_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(
        [sys.executable, __file__, "child", json.dumps(tiny_paths)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) == len(tiny_paths) * len(PROFILES)
    for r in results:
        assert r["max_abs_diff"] == 0.0, r
        assert r["equal"], r
        assert r["grads_finite"], r
    # the profiles really change the numbers (otherwise bit-identity would prove nothing)
    for arch in tiny_paths:
        by = {r["profile"]: r for r in results if r["arch"] == arch}
        assert by["vllm"]["logit_sum"] != by[None]["logit_sum"]
        assert by["vllm-cpu"]["logit_sum"] != by[None]["logit_sum"]


def _child(paths: dict[str, str]) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from gloo_fsdp import init_gloo_fsdp  # tests/support: on PYTHONPATH (child_env)
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlalign_verl.align.patch import apply_alignment, get_alignment

    mesh, mp = init_gloo_fsdp()
    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for arch, path in paths.items():
        config = AutoConfig.from_pretrained(path, attn_implementation="sdpa")
        base = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
        for profile in PROFILES:
            # reference: the same aligned model, parameters in bf16 (buffers stay fp32, as under FSDP2)
            ref = copy.deepcopy(base)
            for p in ref.parameters():
                p.data = p.data.to(torch.bfloat16)
            wrapped = copy.deepcopy(base)
            if profile is not None:
                apply_alignment(ref, regions=("rope", "swiglu", "rmsnorm"), engine=profile)
                apply_alignment(wrapped, regions=("rope", "swiglu", "rmsnorm"), engine=profile)
            for layer in wrapped.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(wrapped, mesh=mesh, mp_policy=mp)
            assert (get_alignment(wrapped) is None) == (profile is None)
            with torch.no_grad():
                want = ref(input_ids=ids).logits
            got = wrapped(input_ids=ids).logits
            got.float().logsumexp(-1).mean().backward()
            grads_finite = all(
                torch.isfinite(p.grad.full_tensor()).all() for p in wrapped.parameters() if p.grad is not None
            )
            got = got.detach()
            results.append(
                {
                    "arch": arch,
                    "profile": profile,
                    "dtype": str(got.dtype),
                    "equal": bool(torch.equal(got, want)),
                    "max_abs_diff": float((got.float() - want.float()).abs().max()),
                    "logit_sum": float(want.float().sum()),
                    "grads_finite": bool(grads_finite),
                }
            )
    dist.destroy_process_group()
    print(json.dumps(results))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "child":
    _child(json.loads(sys.argv[2]))
