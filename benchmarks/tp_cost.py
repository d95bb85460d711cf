"""Cost of the ``tp`` region: forward + backward of an aligned model with and without the split projections.

Run: ``python benchmarks/tp_cost.py [--tokens 512] [--repeat 7] [--hidden 1024 --layers 4] [--moe]
[--checkpointing]``.
A Qwen2-shaped bf16 model (16 heads, MLP 4x hidden) is aligned with ``rope,swiglu,rmsnorm`` (the baseline) and
with ``rope,swiglu,rmsnorm,tp`` at rollout TP 2, 4 and 8 (profile ``vllm``: its reduction data covers TP <= 8;
the arithmetic is the same on every profile). ``--moe``: a Qwen3-MoE-shaped model (16 experts, top-4, expert width
hidden/2) with ``moe`` added to every arm (its experts split by rank with tp, and recomputed in backward).
``--checkpointing``: transformers' gradient checkpointing on (verl's usual setting). Arms run
interleaved, one forward + backward each per repeat; the ratio to the baseline of the same repeat is printed as
median [min, max] over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlalign_verl import apply_alignment, remove_alignment

THREE = ("rope", "swiglu", "rmsnorm")


def build(hidden: int, layers: int, moe: bool = False):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                  vocab_size=4096, tie_word_embeddings=False)  # fmt: skip
    if moe:
        cfg = Qwen3MoeConfig(intermediate_size=4 * hidden, moe_intermediate_size=hidden // 2, num_experts=16,
                             num_experts_per_tok=4, norm_topk_prob=True, head_dim=hidden // 16, **common)  # fmt: skip
    else:
        cfg = Qwen2Config(intermediate_size=4 * hidden, **common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()


def step(model, ids) -> float:
    start = time.perf_counter()
    model(ids).logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE-shaped model, moe added to every arm")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on")
    args = parser.parse_args()
    model = build(args.hidden, args.layers, args.moe)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 4096, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    base_regions = (*THREE, "moe") if args.moe else THREE
    extra = {"unverified": ["moe"]} if args.moe else {}  # the vllm profile's MoE data is read from source
    arms = {
        "three regions": (base_regions, 1),
        **{f"+ tp, TP={n}": ((*base_regions, "tp"), n) for n in (2, 4, 8)},
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(args.repeat + 1):  # the first round warms up every arm
        for name, (regions, tp) in arms.items():
            apply_alignment(model, regions=regions, engine="vllm", rollout_tp=tp, **extra)
            t = step(model, ids)
            remove_alignment(model)
            if rep:
                times[name].append(t)
    base = times["three regions"]
    print(
        f"{'Qwen3-MoE' if args.moe else 'Qwen2'}-shaped bf16, hidden {args.hidden}, {args.layers} layers, {args.tokens} tokens, fwd+bwd"
        f"{', gradient checkpointing' if args.checkpointing else ''}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeat} paired repeats"
    )
    print(f"{'arm':<16} {'median s':>9} {'min s':>8}   ratio to three regions: median [min, max]")
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base, strict=True)]
        print(
            f"{name:<16} {statistics.median(ts):>9.3f} {min(ts):>8.3f}   "
            f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        )


if __name__ == "__main__":
    main()
