"""verl's real trainers' ``fit()`` on CPU with the GPU-only parts replaced (test code, not shipped).

The worker groups and rollout servers of verl 0.9.1 need GPUs; the objects below return what verl's RPCs
return, and everything else is verl's own code: the legacy ``RayPPOTrainer`` (DataProto batches) and the v1
``PPOTrainerSync`` (TransferQueue). The actor's recompute honours the in-run verification marker
(``rlalign_verify``): a pass with it returns the *unaligned* log-probs, given by ``unaligned_offset`` (how far
from the rollout's the unaligned trainer is, against the aligned trainer's known perturbation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from callback_steps import step_tensors, train_log_probs, verl_config
from verl import DataProto

N_PROMPTS, ROLLOUT_N, STEPS = 3, 2, 3
VERIFY_KEY = "rlalign_verify"


class CheckpointManager:
    def update_weights(self, *args, **kwargs):
        return None

    def sleep_replicas(self, *args, **kwargs):
        return None


class ResourcePoolManager:
    def get_n_gpus(self) -> int:
        return 1


def unaligned_log_probs(rollout: torch.Tensor, step: int, scale: float) -> torch.Tensor:
    """The unaligned trainer's log-probs: the rollout's plus ``scale`` times the aligned trainer's error."""
    return rollout + scale * (train_log_probs(rollout, step) - rollout)


class LegacyRollout:
    """What verl's agent-loop manager returns: responses and the engine's log-probs, per step."""

    def __init__(self):
        self.step = 0
        self.outputs: list[dict[str, torch.Tensor]] = []
        self.verify_passes: list[tuple[int, str | None, int]] = []

    def generate_sequences(self, gen_batch: DataProto) -> DataProto:
        self.step += 1
        data = step_tensors(self.step, n=len(gen_batch))
        self.outputs.append(data)
        return DataProto.from_dict(
            data,
            non_tensors={"multi_modal_inputs": np.array([{} for _ in range(len(gen_batch))], dtype=object)},
            meta_info={"timing": {"generate_sequences": 0.01}},
        )


def legacy_trainer(config, tmp_path, monkeypatch, *, unaligned_scale: float = 2.0):
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
    trainer.checkpoint_manager = CheckpointManager()
    trainer.resource_pool_manager = ResourcePoolManager()
    trainer.actor_rollout_wg = object()
    trainer.async_rollout_manager = rollout = LegacyRollout()

    def compute_old_log_prob(batch):  # the actor worker's recomputation (verl returns float32)
        rung = batch.meta_info.get(VERIFY_KEY)
        roll = batch.batch["rollout_log_probs"]
        if rung is None:
            old = train_log_probs(roll, rollout.step)
            if len(batch) == len(rollout.outputs[-1]["rollout_log_probs"]):
                rollout.outputs[-1]["old_log_probs"] = old
        else:
            rollout.verify_passes.append((rollout.step, rung, len(batch)))
            old = unaligned_log_probs(roll, rollout.step, unaligned_scale)
        return DataProto.from_dict({"old_log_probs": old, "entropys": torch.ones_like(old)}), 0.0

    def update_actor(batch):
        return DataProto(meta_info={"metrics": {"actor/grad_norm": [1.5], "actor/pg_loss": [0.1]}})

    trainer._compute_old_log_prob = compute_old_log_prob
    trainer._update_actor = update_actor
    return trainer, rollout


def fit_config(*overrides: str, alignment: str | None = "default"):
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


class V1Rollout:
    """Plays the agent loop (writes each trajectory into TransferQueue) and the actor worker's
    ``compute_log_prob`` (writes ``log_probs``/``entropy`` over prompt+response, as the engine does)."""

    def __init__(self, tq, unaligned_scale: float = 2.0, *, twin_first_group: bool = False):
        self.tq = tq
        self.outputs: list[dict[str, torch.Tensor]] = []
        self.twin_first_group = twin_first_group
        """Sample the first group's two sequences identically (as a fixed sampling seed does)."""
        self.verify_passes: list[tuple[int, str | None, int]] = []
        self.unaligned_scale = unaligned_scale
        self.step = 0

    def put_step(self, step: int, n: int):
        from tensordict import NonTensorStack, TensorDict
        from transfer_queue import KVBatchMeta

        self.step = step
        data = step_tensors(step, n=n)
        if self.twin_first_group:
            for key in ("responses", "response_mask", "rollout_log_probs", "rm_scores"):
                data[key][1] = data[key][0]
        data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], step) * data["response_mask"]
        self.outputs.append(data)
        lens = data["response_mask"].sum(-1).tolist()
        keys = [f"s{step}_{i}" for i in range(n)]
        fields = {
            "prompts": _nested(list(data["prompts"])),
            "responses": _nested([data["responses"][i, :k] for i, k in enumerate(lens)]),
            "response_mask": _nested([data["response_mask"][i, :k] for i, k in enumerate(lens)]),
            "rollout_log_probs": _nested([data["rollout_log_probs"][i, :k] for i, k in enumerate(lens)]),
            # the GRPO group id per sequence (verl's uid: ROLLOUT_N consecutive samples of one prompt)
            "uid": NonTensorStack(*[f"p{step}_{i // ROLLOUT_N}" for i in range(n)]),
        }
        self.tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict(fields, batch_size=n))
        self.batch = KVBatchMeta(partition_id="train", keys=keys, tags=[{"seq_len": 3 + k} for k in lens])

    def sample(self, global_steps, partition_id, batch_size):
        return self.batch, {}

    def compute_log_prob(self, batch):
        from tensordict import TensorDict

        data = self.outputs[-1]
        rung = (batch.extra_info or {}).get(VERIFY_KEY)
        index = [int(k.split("_")[1]) for k in batch.keys]
        values = data["old_log_probs"]
        if rung is not None:
            self.verify_passes.append((self.step, rung, len(index)))
            values = unaligned_log_probs(data["rollout_log_probs"], self.step, self.unaligned_scale)
            values = values * data["response_mask"]
        prompt_len = data["prompts"].shape[1]
        lens = data["response_mask"].sum(-1).tolist()
        rows = []
        for i in index:  # the model's output at t predicts token t+1
            k = lens[i]
            full = torch.zeros(prompt_len + k)
            full[prompt_len - 1 : prompt_len - 1 + k] = values[i, :k]
            rows.append(full)
        fields = {"log_probs": _nested(rows), "entropy": _nested([torch.ones_like(r) for r in rows])}
        self.tq.kv_batch_put(
            keys=batch.keys, partition_id="train", fields=TensorDict(fields, batch_size=len(rows))
        )
        return batch


def v1_trainer(config, transfer_queue, tmp_path, monkeypatch, *, unaligned_scale: float = 2.0, **rollout):
    from verl.trainer.ppo.v1 import get_trainer_cls

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "v1.jsonl"))
    trainer = object.__new__(get_trainer_cls("sync"))  # PPOTrainerSync, the default v1 trainer
    trainer.config = config
    trainer.trainer_mode, trainer.parameter_sync_step, trainer.local_trigger_step = "sync", 1, 0
    trainer.global_steps, trainer.steps_per_epoch, trainer.total_training_steps = 0, STEPS, STEPS
    trainer.use_reference_policy = trainer.use_critic = False
    trainer.checkpoint_manager = CheckpointManager()
    trainer.reward_loop_manager = type("RewardLoop", (), {"reward_loop_worker_handles": []})()
    trainer._init_dump_executor()
    io = V1Rollout(transfer_queue, unaligned_scale, **rollout)
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
    return trainer, io
