"""Does the fp32 lm_head GEMM (vLLM CPU's cast path, ``F.linear(h.float(), W.float())``) give the same bits
for a row whether it is multiplied alone, in a small decode batch, or with a whole training sequence?

Usage: python scripts/fp32_head_rows.py [--hidden 192] [--vocab 1024] [--rows 64]
Prints, per slice size m, the fraction of logits (and of whole rows) equal to the product of all rows at once.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def main() -> None:
    """Compare row-sliced fp32 head products with the all-rows product (1 thread, seeded bf16 inputs)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).to(torch.bfloat16)
    h = torch.randn(args.rows, args.hidden, generator=g).to(torch.bfloat16)
    full = F.linear(h.float(), w.float())  # the engine's fp32 head on CPU: casts, then an fp32 GEMM
    for m in (1, 2, 4, 8, 12, 15, 16, 32, 33):
        parts = torch.cat([F.linear(h[i : i + m].float(), w.float()) for i in range(0, args.rows, m)])
        same = parts == full
        print(
            f"rows per product {m:>3}: logits equal {same.float().mean():.4f}, rows equal {same.all(-1).float().mean():.4f}"
        )


if __name__ == "__main__":
    main()
