"""The one FSDP2-on-CPU setup the FSDP2 tests share: a gloo process group, a CPU mesh, verl's bf16 policy.

Imported inside the tests' child processes (``python tests/<layer>/test_x.py child ...``), started with
:func:`child_env`, which puts ``tests/support`` on their ``PYTHONPATH`` (as pytest's ``pythonpath`` does here).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent


def child_env(**extra: str) -> dict[str, str]:
    """This environment, plus ``extra``, with ``tests/support`` first on ``PYTHONPATH``."""
    path = os.pathsep.join(p for p in (str(SUPPORT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo_fsdp(world: int = 1, rank: int = 0):
    """``(mesh, mp_policy)`` after joining a gloo group of ``world`` ranks (a single rank sets its own env).

    The policy is verl's FSDP2 actor setting: bf16 parameters, fp32 gradient reduction, forward inputs cast.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if world == 1:
        port = str(free_port())
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", world_size=world, rank=rank)
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
    )
    return mesh, mp
