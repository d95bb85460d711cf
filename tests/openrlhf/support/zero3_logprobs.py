"""Run as a script (own process: it initialises torch.distributed): an aligned OpenRLHF ``Actor`` under
a real DeepSpeed ZeRO-3 engine (CPU, gloo, one rank) against the same Actor without DeepSpeed.

ZeRO-3 partitions every parameter and gathers a module's parameters only around that module's own
forward; the aligned decoder layer reads its RMSNorm weights without calling the norm modules.
Prints one JSON line: the largest log-prob differences.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import rlalign_cpu_test_shims

rlalign_cpu_test_shims.install()

with socket.socket() as _sock:
    _sock.bind(("127.0.0.1", 0))
    _port = _sock.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from openrlhf.models import Actor  # noqa: E402

from rlalign_verl.openrlhf import setup  # noqa: E402
from rlalign_verl.openrlhf.settings import Settings  # noqa: E402

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "bf16": {"enabled": True},
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
}


def log_probs(path: str, regions: tuple[str, ...], zero3: bool) -> torch.Tensor:
    setup.install(Settings.build(regions=regions, profile="vllm-cpu", metrics=False))
    model = Actor(path, attn_implementation="sdpa", param_dtype="bf16")
    if zero3:
        model, *_ = deepspeed.initialize(model=model, config=ZERO3, model_parameters=None)
    model.eval()
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, 1000, (2, 16), generator=g)
    with torch.no_grad():
        return model(seqs, torch.ones(2, 8), attention_mask=torch.ones_like(seqs)).float()


def main(path: str) -> None:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    regions = ("rope", "swiglu", "rmsnorm")
    aligned_z3 = log_probs(path, regions, zero3=True)
    aligned = log_probs(path, regions, zero3=False)
    unaligned = log_probs(path, (), zero3=False)
    print(
        json.dumps(
            {
                "zero3_vs_plain": (aligned_z3 - aligned).abs().max().item(),
                "aligned_vs_unaligned": (aligned - unaligned).abs().max().item(),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
