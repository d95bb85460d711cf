"""verl's real trainers' fit() on CPU (legacy RayPPOTrainer and v1) log the mismatch metrics every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from callback_steps import logged_fit_steps, read_jsonl, step_tensors, train_log_probs, verl_config  # noqa: E402
from verl import DataProto  # noqa: E402

pytestmark = pytest.mark.verl
# fixtures trainer_modules, warnings_log: tests/support/callback_steps.py
pytest_plugins = ["callback_steps"]


# ----------------------------------------------------------------------------------------------
# The real trainers' fit() on CPU: the worker groups / rollout servers (GPU-only in verl 0.9.1) are
# replaced by small objects that return what verl's RPCs return; everything else is verl's code.
# ----------------------------------------------------------------------------------------------

N_PROMPTS, ROLLOUT_N, STEPS = 3, 2, 3


class _CheckpointManager:
    def update_weights(self, *args, **kwargs):
        return None

    def sleep_replicas(self, *args, **kwargs):
        return None


class _ResourcePoolManager:
    def get_n_gpus(self) -> int:
        return 1


class _Rollout:
    """What verl's agent-loop manager returns: responses and the engine's log-probs, per step."""

    def __init__(self):
        self.step = 0
        self.outputs: list[dict[str, torch.Tensor]] = []

    def generate_sequences(self, gen_batch: DataProto) -> DataProto:
        self.step += 1
        data = step_tensors(self.step, n=len(gen_batch))
        self.outputs.append(data)
        out = DataProto.from_dict(
            data,
            non_tensors={"multi_modal_inputs": np.array([{} for _ in range(len(gen_batch))], dtype=object)},
            meta_info={"timing": {"generate_sequences": 0.01}},
        )
        return out


def _legacy_trainer(config, tmp_path, monkeypatch):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "legacy.jsonl"))
    trainer = object.__new__(RayPPOTrainer)
    trainer.config = config
    trainer._init_dump_executor()
    trainer.train_dataloader = [
        {"prompt_index": torch.arange(N_PROMPTS), "data_source": np.array(["toy"] * N_PROMPTS, dtype=object)}
        for _ in range(STEPS)
    ]
    trainer.train_dataset = trainer.train_dataloader
    trainer.total_training_steps = STEPS
    trainer.use_rm = trainer.use_reference_policy = trainer.use_critic = False
    trainer.checkpoint_manager = _CheckpointManager()
    trainer.resource_pool_manager = _ResourcePoolManager()
    trainer.actor_rollout_wg = object()
    trainer.async_rollout_manager = rollout = _Rollout()

    def compute_old_log_prob(batch):  # the actor worker's recomputation (verl returns float32)
        old = train_log_probs(batch.batch["rollout_log_probs"], rollout.step)
        rollout.outputs[-1]["old_log_probs"] = old
        return DataProto.from_dict({"old_log_probs": old, "entropys": torch.ones_like(old)}), 0.0

    def update_actor(batch):
        return DataProto(meta_info={"metrics": {"actor/grad_norm": [1.5], "actor/pg_loss": [0.1]}})

    trainer._compute_old_log_prob = compute_old_log_prob
    trainer._update_actor = update_actor
    return trainer, rollout


def _fit_config(*overrides: str, alignment: str | None = "default"):
    return verl_config(
        "trainer.logger=[console,file]",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.balance_batch=false",
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        "algorithm.adv_estimator=grpo",
        *overrides,
        alignment=alignment,
    )


@pytest.mark.parametrize("rollout_is", [None, "token"], ids=["plain", "with-TIS"])
def test_legacy_trainer_fit_logs_mismatch_every_step(
    trainer_modules, tmp_path, monkeypatch, warnings_log, rollout_is
):
    overrides = ["trainer.use_v1=false", "actor_rollout_ref.actor.clip_ratio_high=0.28"]
    if rollout_is:  # verl's rollout correction (truncated IS, token level) active at the same time
        overrides.append(f"algorithm.rollout_correction.rollout_is={rollout_is}")
    trainer, rollout = _legacy_trainer(_fit_config(*overrides, alignment="all"), tmp_path, monkeypatch)
    trainer.fit()

    for logged in logged_fit_steps(tmp_path / "legacy.jsonl", rollout.outputs):
        assert "training/rollout_probs_diff_mean" in logged and "critic/score/mean" in logged
        if rollout_is:
            assert any(k.startswith("rollout_corr/") for k in logged)
    banner = [r.getMessage() for r in warnings_log.records if "alignment regions=" in r.getMessage()]
    # the config skipped the driver's validation and has no rollout.name: the callback says why it has no profile
    assert len(banner) == 1 and banner[0].startswith(
        "alignment regions=rope,swiglu,rmsnorm profile=auto (unresolved: "
    )
    assert banner[0].endswith("; mismatch metrics (mismatch/*) on")


@pytest.mark.parametrize("setting", ["metrics=false", "no alignment section"])
def test_legacy_trainer_fit_without_metrics(trainer_modules, tmp_path, monkeypatch, setting):
    if setting == "metrics=false":
        config = _fit_config("trainer.use_v1=false", "alignment.metrics=false")
    else:
        config = _fit_config("trainer.use_v1=false", alignment=None)
    trainer, _ = _legacy_trainer(config, tmp_path, monkeypatch)
    trainer.fit()
    rows = read_jsonl(tmp_path / "legacy.jsonl")
    assert len(rows) == STEPS
    for row in rows:
        assert not any(k.startswith("mismatch/") for k in row["data"])
        assert "training/rollout_probs_diff_mean" in row["data"]


@pytest.fixture(scope="module")
def transfer_queue():
    """A real local Ray instance with verl's TransferQueue (the v1 trainer's data plane)."""
    ray = pytest.importorskip("ray")
    tq = pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    if started:
        ray.shutdown()


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


class _V1Rollout:
    """Plays the agent loop (writes each trajectory into TransferQueue) and the actor worker's
    ``compute_log_prob`` (writes ``log_probs``/``entropy`` over prompt+response, as the engine does)."""

    def __init__(self, tq):
        self.tq = tq
        self.outputs: list[dict[str, torch.Tensor]] = []

    def put_step(self, step: int, n: int):
        from tensordict import TensorDict
        from transfer_queue import KVBatchMeta

        data = step_tensors(step, n=n)
        data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], step) * data["response_mask"]
        self.outputs.append(data)
        lens = data["response_mask"].sum(-1).tolist()
        keys = [f"s{step}_{i}" for i in range(n)]
        fields = {
            "prompts": _nested(list(data["prompts"])),
            "responses": _nested([data["responses"][i, :k] for i, k in enumerate(lens)]),
            "response_mask": _nested([data["response_mask"][i, :k] for i, k in enumerate(lens)]),
            "rollout_log_probs": _nested([data["rollout_log_probs"][i, :k] for i, k in enumerate(lens)]),
        }
        self.tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict(fields, batch_size=n))
        self.batch = KVBatchMeta(partition_id="train", keys=keys, tags=[{"seq_len": 3 + k} for k in lens])

    def sample(self, global_steps, partition_id, batch_size):
        return self.batch, {}

    def compute_log_prob(self, batch):
        from tensordict import TensorDict

        data = self.outputs[-1]
        prompt_len = data["prompts"].shape[1]
        lens = data["response_mask"].sum(-1).tolist()
        rows = []
        for i, k in enumerate(lens):  # the model's output at t predicts token t+1
            full = torch.zeros(prompt_len + k)
            full[prompt_len - 1 : prompt_len - 1 + k] = data["old_log_probs"][i, :k]
            rows.append(full)
        fields = {"log_probs": _nested(rows), "entropy": _nested([torch.ones_like(r) for r in rows])}
        self.tq.kv_batch_put(
            keys=batch.keys, partition_id="train", fields=TensorDict(fields, batch_size=len(rows))
        )
        return batch


def test_v1_trainer_fit_logs_mismatch_every_step(trainer_modules, transfer_queue, tmp_path, monkeypatch):
    from verl.trainer.ppo.v1 import get_trainer_cls

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "v1.jsonl"))
    config = _fit_config(
        "trainer.use_v1=true",
        f"data.train_batch_size={N_PROMPTS}",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
    )
    trainer = object.__new__(get_trainer_cls("sync"))  # PPOTrainerSync, the default v1 trainer
    trainer.config = config
    trainer.trainer_mode, trainer.parameter_sync_step, trainer.local_trigger_step = "sync", 1, 0
    trainer.global_steps, trainer.steps_per_epoch, trainer.total_training_steps = 0, STEPS, STEPS
    trainer.use_reference_policy = trainer.use_critic = False
    trainer.checkpoint_manager = _CheckpointManager()
    trainer.reward_loop_manager = type("RewardLoop", (), {"reward_loop_worker_handles": []})()
    trainer._init_dump_executor()
    io = _V1Rollout(transfer_queue)
    trainer.replay_buffer = io
    trainer.actor_rollout_wg = io

    def prepare_step():  # the agent loop finishes this step's rollouts into TransferQueue
        io.put_step(trainer.global_steps, N_PROMPTS * ROLLOUT_N)
        return {}

    def update_actor(batch, metrics):
        metrics.update({"actor/grad_norm": 1.5, "actor/pg_loss": 0.1})
        return batch

    def compute_metrics(batch, metrics, timing_raw, global_steps, epoch):  # verl's needs rm/values fields
        metrics.update({"training/global_step": global_steps, "training/epoch": epoch})

    trainer.prepare_step = prepare_step
    trainer._balance_batch = lambda batch, metrics: batch
    trainer._compute_advantage = lambda batch, metrics: batch
    trainer._update_actor = update_actor
    trainer._compute_metrics = compute_metrics
    trainer.fit(agent_loop_manager=None)

    for logged in logged_fit_steps(tmp_path / "v1.jsonl", io.outputs):
        assert {"training/rollout_probs_diff_mean", "actor/entropy", "actor/grad_norm"} <= set(logged)
