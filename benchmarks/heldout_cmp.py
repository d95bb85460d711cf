"""Held-out exactness check (step 2: trainer side): HF + apply_alignment vs the engine's saved raw logits.

Usage: python benchmarks/heldout_cmp.py ARCH eager|compiled bf16|fp32 none rope+swiglu+rmsnorm+attention[@sdpa-fp32] ...
(a ``compiled_norm`` / ``compile`` item in a setting turns on ``apply_alignment(compiled_norm=True)`` /
``compile=True``).
Prints per setting: tokens with delta-logp exactly 0, mean |delta-logp|, logit rows bit-identical to the engine's.
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlalign_verl import apply_alignment

root = Path(os.environ.get("RLALIGN_CACHE", "/tmp")) / "heldout"


def run(arch, mode, head, regions, engine, **kw):
    rows = json.loads((root / f"{arch}-{mode}-{head}.json").read_text())
    m = AutoModelForCausalLM.from_pretrained(
        root / arch, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    if regions:
        apply_alignment(m, regions=regions, engine=engine, **kw)
    n = eq = lexact = 0
    tot = 0.0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor(r["prompt"] + r["resp"])
            lo = m(input_ids=ids[None]).logits[0].float()
            P = len(r["prompt"])
            tl = lo[P - 1 : -1]
            el = torch.tensor(r["logits"], dtype=torch.float32)
            resp = torch.tensor(r["resp"])
            d = (tl.log_softmax(-1).gather(-1, resp[:, None]) - el.log_softmax(-1).gather(-1, resp[:, None]))[
                :, 0
            ]
            n += d.numel()
            eq += int((d == 0).sum())
            tot += float(d.abs().sum())
            lexact += int((tl == el).all(-1).sum())
    print(
        f"{arch} {mode} head={head} regions={regions} {kw}: tokens {n} dlogp==0 {eq} ({eq / n:.4f}) mean|d| {tot / n:.3e} logits-rows-exact {lexact}",
        flush=True,
    )


if __name__ == "__main__":
    arch, mode, head = sys.argv[1:4]
    eng = "vllm-cpu-eager" if mode == "eager" else "vllm-cpu"
    for spec in sys.argv[4:]:
        regs, _, var = spec.partition("@")
        items = [x for x in regs.split("+") if x and x != "none"]
        regions = [x for x in items if x not in ("compiled_norm", "compile")]
        kw = {"attention": var} if var else {}
        for opt in ("compiled_norm", "compile"):
            if opt in items:
                kw[opt] = True
        if head == "bf16":
            kw["head_dtype"] = "model"
        run(arch, mode, head, regions, eng, **kw)
