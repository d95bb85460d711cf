"""Runs written by verl's real Tracking backends (file JSONL, TensorBoard) for the report tests, and
``call``: the ``rlalign-verl report`` command in-process."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlalign_verl.tools.report import command


def step_metrics(step: int, gap: float, with_training: bool = True) -> dict[str, float]:
    m = {
        "mismatch/logp_abs_diff_mean": gap * (1 + 0.1 * step),
        "mismatch/logp_abs_diff_p99": 8 * gap,
        "mismatch/kl_k3": gap * gap / 2,
        "mismatch/ratio_max": 1 + 10 * gap * step,
        "mismatch/ratio_min": 1 / (1 + 10 * gap * step),
        "mismatch/ratio_clip_frac": min(1.0, gap * step),
        "mismatch/seq_log_ratio_abs_mean": 5 * gap,
        "mismatch/num_tokens": 1000,
    }
    if step % 2 == 1:  # verify steps: 1, 3, 5
        m.update({"mismatch/verify/aligned": gap, "mismatch/verify/unaligned": 2 * gap, "mismatch/verify/gain": 2.0,
                  "mismatch/verify/gain_lo": 1.5, "mismatch/verify/gain_hi": 2.5, "mismatch/verify/verdict": 1.0})  # fmt: skip
    if with_training:
        m.update(
            {"critic/score/mean": 0.1 * step, "actor/entropy": 1.0 - 0.05 * step, "actor/grad_norm": 2.0}
        )
    return m


def write_file_run(path: Path, monkeypatch, gap: float, steps: int = 6, with_training: bool = True) -> Path:
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    from verl.utils.tracking import Tracking

    tracking = Tracking(project_name="p", experiment_name=path.stem, default_backend=["file"])
    for step in range(1, steps + 1):
        data = step_metrics(step, gap, with_training)
        if step == 3:
            data["mismatch/kl_k3"] = float("nan")  # serialized as null: skipped, not a crash
            data["note"] = "text values are ignored"
        tracking.log(data=data, step=step)
    tracking.finish()
    return path


def write_tensorboard_run(directory: Path, monkeypatch, gap: float, steps: int = 6) -> Path:
    monkeypatch.setenv("TENSORBOARD_DIR", str(directory))
    from verl.utils.tracking import Tracking

    tracking = Tracking(project_name="p", experiment_name="tb", default_backend=["tensorboard"])
    for step in range(1, steps + 1):
        tracking.log(data=step_metrics(step, gap), step=step)
    tracking.finish()
    return directory


def call(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="rlalign-verl")
    command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", *argv])
    return command.run(args)
