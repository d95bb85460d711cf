"""Inputs of the tiny CPU GRPO run (``recipes/grpo_tiny_cpu.sh``): a model, prompts and a rule reward.

Nothing is downloaded: the model is the deterministic tiny Qwen2 built locally, the prompts are
seeded word sequences written as verl's RL parquet (``prompt`` as chat messages, ``reward_model``
with a ground truth), and the reward is :func:`compute_score`, which verl loads from this file through
``reward.custom_reward_function.path``.

``python -m rlalign_verl.tools.tiny_grpo OUT_DIR [--arch qwen2] [--num-prompts 64]`` writes
``OUT_DIR/train.parquet`` and ``OUT_DIR/val.parquet`` and prints one JSON line with the model path,
the two data files and this file's path (the reward function).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "rlalign_tiny_copy"
_WORDS = (
    "red green blue yellow cat dog bird fish tree house road city river stone robot count sort small "
    "large first last one two three four five six seven eight nine ten model policy reward answer"
).split()


def make_rows(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` prompts in verl's RL dataset layout; the ground truth is the prompt's word list."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 6))]
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": "Repeat: " + " ".join(words)}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": " ".join(words)},
                "extra_info": {"index": i},
            }
        )
    return rows


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """Rule reward in [0, 1]: how much of the response copies the prompt's words.

    Half the fraction of the prompt's words that appear in the response, half the fraction of the
    response's non-space characters that occur in those words. The character part is dense, so a
    random tiny policy's samples already differ in reward and GRPO's group-normalized advantages are
    not all zero (the word part alone is almost always 0 for a random policy).
    """
    wanted = ground_truth.lower().split()
    chars = [c for c in solution_str.lower() if not c.isspace()]
    if not wanted or not chars:
        return 0.0
    said = set(solution_str.lower().split())
    letters = set("".join(wanted))
    words = sum(w in said for w in wanted) / len(wanted)
    return 0.5 * words + 0.5 * sum(c in letters for c in chars) / len(chars)


def prepare(out_dir: str | Path, *, arch: str = "qwen2", num_prompts: int = 64) -> dict[str, str]:
    """Build (or reuse) the tiny checkpoint and write the train/val parquet files; return the paths."""
    import pandas as pd

    from rlalign_verl.tools.diagnose.tiny import build_tiny_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_checkpoint(arch)
    paths = {"model": str(model), "reward": str(Path(__file__).resolve())}
    for split, seed, n in (("train", 0, num_prompts), ("val", 1, max(4, num_prompts // 8))):
        path = out / f"{split}.parquet"
        pd.DataFrame(make_rows(n, seed=seed)).to_parquet(path)
        paths[split] = str(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    """CLI: prepare the inputs and print their paths as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--num-prompts", type=int, default=64)
    args = parser.parse_args(argv)
    print(json.dumps(prepare(args.out_dir, arch=args.arch, num_prompts=args.num_prompts)))


if __name__ == "__main__":
    main()
