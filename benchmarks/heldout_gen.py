"""Held-out exactness check of the opt-in regions against the real vLLM CPU engine (step 1: engine side).

Builds tiny Qwen2/Qwen3/Llama checkpoints of shapes no test uses (intermediate 384: on AMX CPUs oneDNN's bf16
GEMM with K >= 512 rounds differently for different row counts, which no trainer-side region can mirror) and
samples 12 prompts x 32 tokens, saving the raw logits of every step (logprobs_mode=raw_logits, full vocab).
Usage: python benchmarks/heldout_gen.py qwen2:eager:bf16 qwen2:eager:fp32 llama:compiled:bf16 ...
(fp32 = --hf-overrides head_dtype float32). Step 2: benchmarks/heldout_cmp.py.
"""

import json
import os
import sys
from pathlib import Path

from rlalign_verl.tools.diagnose import tiny
from rlalign_verl.tools.diagnose.tiny import TinySpec, _write_checkpoint

SPECS = {
    "qwen2": TinySpec("qwen2", 192, 384, 3, 3, 1, 64, rope_theta=1_000_000.0),
    "qwen3": TinySpec("qwen3", 224, 384, 3, 4, 2, 64, rope_theta=1_000_000.0),
    "llama": TinySpec("llama", 320, 384, 3, 5, 1, 64, rope_theta=10_000.0),
}
root = Path(os.environ.get("RLALIGN_CACHE", "/tmp")) / "heldout"
root.mkdir(parents=True, exist_ok=True)


def build(arch):
    p = root / arch
    if not (p / "model.safetensors").exists():
        p.mkdir(exist_ok=True)
        _write_checkpoint(p, SPECS[arch], 7)
    return p


if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    for job in sys.argv[1:]:
        arch, mode, head = job.split(":")
        out = root / f"{arch}-{mode}-{head}.json"
        if out.exists():
            continue
        p = build(arch)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(p)
        prompts = tiny.tiny_prompts(tok, 12, seed=3)
        kw = {"hf_overrides": {"head_dtype": "float32"}} if head == "fp32" else {}
        llm = LLM(
            model=str(p),
            dtype="bfloat16",
            seed=0,
            max_model_len=256,
            max_num_seqs=16,
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=(mode == "eager"),
            enable_prefix_caching=False,
            logprobs_mode="raw_logits",
            max_logprobs=-1,
            **kw,
        )
        V = llm.llm_engine.vllm_config.model_config.get_vocab_size()
        params = [
            SamplingParams(
                temperature=1.0, max_tokens=32, min_tokens=32, ignore_eos=True, logprobs=-1, seed=i
            )
            for i in range(len(prompts))
        ]
        outs = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], params, use_tqdm=False)
        rows = []
        for q, o in zip(prompts, outs, strict=True):
            c = o.outputs[0]
            resp = list(c.token_ids)
            logits = [[step[t].logprob for t in range(V)] for step in c.logprobs]
            rows.append({"prompt": q, "resp": resp, "logits": logits})
        out.write_text(json.dumps(rows))
        print("wrote", out, flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
