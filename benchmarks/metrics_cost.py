"""Cost of ``compute_mismatch_metrics`` on a [256, 4096] step batch (CPU, and CUDA when available).

Run: ``python benchmarks/metrics_cost.py [--batch 256] [--length 4096] [--repeat 10]``.
Prints a table of median/min wall time per call; verl's own ``calculate_debug_metrics`` on the same
batch is timed too when verl is installed, for scale (in verl both run in the TaskRunner, on CPU tensors).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from rlalign_verl.measure.metrics import compute_mismatch_metrics


def make_batch(batch: int, length: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    rollout = -torch.rand(batch, length, generator=g) * 4
    train = rollout + 0.02 * torch.randn(batch, length, generator=g)
    return train.to(device, dtype), rollout.to(device, torch.float32), mask.to(device)


def timed(fn: Callable[[], object], device: str, repeat: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    try:
        from verl import DataProto
        from verl.utils.debug.metrics import calculate_debug_metrics
    except ImportError:
        DataProto = calculate_debug_metrics = None

    print(
        f"batch [{args.batch}, {args.length}], torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    print(f"{'device':<7} {'train dtype':<12} {'what':<34} {'median ms':>10} {'min ms':>8}")
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16):
            train, rollout, mask = make_batch(args.batch, args.length, dtype, device)
            n_valid = int(mask.sum())
            cases: list[tuple[str, Callable[[], object]]] = [
                (
                    "mismatch/* (all keys)",
                    lambda a=train, b=rollout, m=mask: compute_mismatch_metrics(a, b, m),
                ),
                (
                    "mismatch/* quantiles=False",
                    lambda a=train, b=rollout, m=mask: compute_mismatch_metrics(a, b, m, quantiles=False),
                ),
            ]
            if DataProto is not None:
                responses = torch.zeros_like(mask)
                data = DataProto.from_dict(
                    {
                        "old_log_probs": train.float(),
                        "rollout_log_probs": rollout,
                        "response_mask": mask,
                        "responses": responses,
                    }
                )
                cases.append(
                    ("verl calculate_debug_metrics", lambda data=data: calculate_debug_metrics(data))
                )
            for what, fn in cases:
                t = timed(fn, device, args.repeat)
                print(
                    f"{device:<7} {str(dtype).replace('torch.', ''):<12} {what:<34} "
                    f"{statistics.median(t):>10.1f} {min(t):>8.1f}"
                )
        print(f"({device}: {n_valid} valid tokens of {args.batch * args.length})")


if __name__ == "__main__":
    main()
