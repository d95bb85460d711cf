"""The callback's per-step mismatch metrics with real verl objects: DataProto, Tracking, config, aggregator."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from callback_steps import (  # noqa: E402
    ALL_KEYS,
    assert_matches,
    expected,
    read_jsonl,
    step_tensors,
    train_log_probs,
    verl_config,
)
from verl import DataProto  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402
from verl.utils.tracking import Tracking  # noqa: E402

from rlalign_verl.verl import trainer_callback as tc  # noqa: E402

pytestmark = pytest.mark.verl
# fixtures base_config: tests/support/callback_steps.py
pytest_plugins = ["callback_steps"]


def test_step_metrics_reach_real_tracking_every_step(base_config, tmp_path, monkeypatch, capsys):
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracking = Tracking(project_name="p", experiment_name="e", default_backend=["console", "file"])
    wants = []
    for step in range(1, 5):
        data = step_tensors(step)
        data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], step)
        batch = DataProto.from_dict(data)
        metrics = {"actor/entropy": 0.5}
        metrics.update(calculate_debug_metrics(batch))  # verl's own rollout-vs-actor metrics
        metrics.update(tc.step_mismatch_metrics(batch, base_config))
        wants.append(expected(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"]))
        tracking.log(data=metrics, step=step)
    tracking.finish()

    rows = read_jsonl(path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row, want in zip(rows, wants, strict=True):
        assert ALL_KEYS <= set(row["data"])
        assert {"training/rollout_probs_diff_mean", "actor/entropy"} <= set(row["data"])
        assert_matches(row["data"], want)
    # clip_ratio_high=0.28 from the config is used: some ratios lie in (1.2, 1.28].
    assert any(
        want["mismatch/ratio_clip_frac"]
        != expected(
            train_log_probs(step_tensors(s)["rollout_log_probs"], s),
            step_tensors(s)["rollout_log_probs"],
            step_tensors(s)["response_mask"],
            high=0.2,
        )["mismatch/ratio_clip_frac"]
        for s, want in enumerate(wants, start=1)
    )
    console = capsys.readouterr().out
    assert console.count("mismatch/kl_k3") == 4


def test_step_metrics_options_from_config(base_config):
    data = step_tensors(7)
    data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], 7)
    batch = DataProto.from_dict(data)
    off = verl_config("alignment.metrics=false")
    assert tc.step_mismatch_metrics(batch, off) == {}
    no_q = verl_config("alignment.experimental.metrics_quantiles=false")
    keys = set(tc.step_mismatch_metrics(batch, no_q))
    assert keys == ALL_KEYS - {
        "mismatch/logp_abs_diff_p50",
        "mismatch/logp_abs_diff_p90",
        "mismatch/logp_abs_diff_p99",
    }
    # bf16 trainer log-probs (verl on CPU keeps log_softmax in bf16) work too.
    data["old_log_probs"] = data["old_log_probs"].to(torch.bfloat16)
    out = tc.step_mismatch_metrics(DataProto.from_dict(data), base_config)
    assert out["mismatch/logp_abs_diff_mean"] == pytest.approx(
        expected(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"])[
            "mismatch/logp_abs_diff_mean"
        ]
    )


def test_the_request_is_read_once_per_run_not_every_step(base_config, monkeypatch):
    """Validated once: the driver's resolved spec is parsed on the first step and reused at every later one."""
    from rlalign_verl.request.spec import AlignmentSpec
    from rlalign_verl.verl.config import write_worker_spec

    data = step_tensors(7)
    data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], 7)
    batch = DataProto.from_dict(data)
    config = verl_config("alignment.regions=[rope]")
    write_worker_spec(config, AlignmentSpec.parse(regions=["rope"], engine="vllm"))
    parsed = []
    real = AlignmentSpec.from_json.__func__
    monkeypatch.setattr(
        AlignmentSpec, "from_json", classmethod(lambda cls, raw: parsed.append(1) or real(cls, raw))
    )
    for _ in range(3):
        assert tc.step_mismatch_metrics(batch, config)["mismatch/num_tokens"] > 0
    assert len(parsed) == 1 and tc.run_spec(config).regions == ("rope",)


def test_metric_names_aggregate_correctly_in_v1_metrics_aggregator():
    """v1 merges per-mini-batch metrics by keyword in the name (max/min/sum/mean): ours must fit."""
    from verl.trainer.ppo.v1.utils import MetricsAggregator

    agg = MetricsAggregator()
    kinds = {key: agg._get_aggregation_type(key) for key in ALL_KEYS}
    for key, kind in kinds.items():
        if key.endswith("_max"):
            assert kind == "max", key
        elif key.endswith("_min"):
            assert kind == "min", key
        else:
            assert kind == "weighted_avg", key
