"""The mismatch-metrics callback with real verl objects: DataProto, Tracking, config, trainers' fit()."""

from __future__ import annotations

import importlib
import json
import logging
import os

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402
from verl.utils.tracking import Tracking  # noqa: E402

from rlalign_verl.errors import AlignmentError  # noqa: E402
from rlalign_verl.metrics import COUNT_NAMES, METRIC_NAMES  # noqa: E402
from rlalign_verl.verl import trainer_callback as tc  # noqa: E402

pytestmark = pytest.mark.verl

ALL_KEYS = {f"mismatch/{k}" for k in METRIC_NAMES + COUNT_NAMES}
VERL_CONFIG_DIR = os.path.join(os.path.dirname(importlib.import_module("verl").__file__), "trainer", "config")


def verl_config(*overrides: str, alignment: str | None = "default"):
    """verl's real ppo_trainer config (hydra compose), with our alignment config group."""
    extra = ["hydra.searchpath=[pkg://rlalign_verl.configs]"]
    if alignment:
        extra.append(f"+alignment={alignment}")
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose("ppo_trainer", overrides=extra + list(overrides))


@pytest.fixture(scope="module")
def base_config():
    return verl_config("actor_rollout_ref.actor.clip_ratio_high=0.28")


@pytest.fixture
def warnings_log(caplog):
    """Records of the plugin's logger (it does not propagate to the root logger caplog listens on)."""
    plugin_logger = logging.getLogger("rlalign_verl.verl")
    plugin_logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    yield caplog
    plugin_logger.removeHandler(caplog.handler)


def step_tensors(seed: int, n: int = 6, prompt_len: int = 3, resp_len: int = 8) -> dict[str, torch.Tensor]:
    """Rollout output of one step: ragged responses (right padded), log-probs of the sampled tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, resp_len + 1, (n,), generator=g)
    lengths[0] = resp_len
    response_mask = (torch.arange(resp_len)[None, :] < lengths[:, None]).long()
    rollout = -torch.rand(n, resp_len, generator=g) * 3 * response_mask
    prompts = torch.randint(3, 50, (n, prompt_len), generator=g)
    responses = torch.randint(3, 50, (n, resp_len), generator=g) * response_mask
    attention_mask = torch.cat([torch.ones(n, prompt_len, dtype=torch.long), response_mask], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "rollout_log_probs": rollout,
        "rm_scores": torch.zeros(n, resp_len).scatter_(
            1, (lengths - 1)[:, None], torch.rand(n, 1, generator=g)
        ),
    }


def train_log_probs(rollout: torch.Tensor, seed: int) -> torch.Tensor:
    """The trainer's recomputation: the rollout's plus a known perturbation (ratios 0.7..1.35)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return rollout + (torch.rand(rollout.shape, generator=g) * 0.65 - 0.35)


def expected(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, low=0.2, high=0.28) -> dict:
    """A few metrics in numpy, independently of rlalign_verl.metrics."""
    m = mask.numpy().astype(bool)
    d = train.double().numpy()[m] - rollout.double().numpy()[m]
    r = np.exp(d)
    seq = np.abs(((train.double() - rollout.double()) * mask).sum(-1).numpy())
    return {
        "mismatch/num_tokens": int(m.sum()),
        "mismatch/logp_abs_diff_mean": float(np.abs(d).mean()),
        "mismatch/kl_k3": float(np.mean(r - 1 - d)),
        "mismatch/ratio_clip_frac": float(np.mean((r < 1 - low) | (r > 1 + high))),
        "mismatch/ratio_max": float(r.max()),
        "mismatch/seq_log_ratio_abs_max": float(seq.max()),
    }


def assert_matches(logged: dict, want: dict) -> None:
    for key, value in want.items():
        assert logged[key] == pytest.approx(value, rel=1e-6), key


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def logged_fit_steps(path, outputs: list[dict]) -> list[dict]:
    """A 3-step fit's logged metrics; each step's mismatch/* checked against :func:`expected` on its batch."""
    rows = read_jsonl(path)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row, data in zip(rows, outputs, strict=True):
        logged = row["data"]
        assert ALL_KEYS <= set(logged), sorted(ALL_KEYS - set(logged))
        assert_matches(
            logged, expected(data["old_log_probs"], data["rollout_log_probs"], data["response_mask"])
        )
    return [row["data"] for row in rows]


# ----------------------------------------------------------------------------------------------
# step_mismatch_metrics with real DataProto batches and a real Tracking
# ----------------------------------------------------------------------------------------------


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
    no_q = verl_config("+alignment.metrics_quantiles=false")
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


def _broken_batches():
    good = step_tensors(3)
    good["old_log_probs"] = train_log_probs(good["rollout_log_probs"], 3)
    no_rollout = {k: v for k, v in good.items() if k != "rollout_log_probs"}
    wider = dict(good, rollout_log_probs=torch.zeros(6, 9))
    no_mask = {k: v for k, v in good.items() if k not in ("response_mask", "attention_mask")}
    return {
        "missing rollout_log_probs": (DataProto.from_dict(no_rollout), "rollout_log_probs"),
        "shape mismatch": (DataProto.from_dict(wider), "shape"),
        "no mask": (DataProto.from_dict(no_mask), "response_mask"),
        "not a DataProto": (None, "DataProto"),
    }


@pytest.mark.parametrize(
    "case", ["missing rollout_log_probs", "shape mismatch", "no mask", "not a DataProto"]
)
def test_broken_input_warns_and_returns_nothing(base_config, warnings_log, case):
    batch, words = _broken_batches()[case]
    assert tc.step_mismatch_metrics(batch, base_config) == {}
    messages = [r.getMessage() for r in warnings_log.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "skipped for this step" in messages[0] and words in messages[0]


def test_all_nan_step_warns_and_logs_only_counts(base_config, warnings_log):
    data = step_tensors(4)
    data["old_log_probs"] = torch.full_like(data["rollout_log_probs"], float("nan"))
    out = tc.step_mismatch_metrics(DataProto.from_dict(data), base_config)
    n = int(data["response_mask"].sum())
    assert out == {"mismatch/num_tokens": 0, "mismatch/num_seqs": 0, "mismatch/nonfinite_tokens": n}
    assert any("NaN/inf" in r.getMessage() for r in warnings_log.records if r.levelno == logging.WARNING)


def test_check_metrics_config():
    with pytest.raises(AlignmentError, match=r"actor_rollout_ref\.rollout\.calculate_log_probs=True"):
        tc.check_metrics_config(verl_config("actor_rollout_ref.rollout.calculate_log_probs=false"))
    tc.check_metrics_config(verl_config())  # verl's default: calculate_log_probs=True
    tc.check_metrics_config(
        verl_config("actor_rollout_ref.rollout.calculate_log_probs=false", "alignment.metrics=false")
    )
    tc.check_metrics_config(
        verl_config("actor_rollout_ref.rollout.calculate_log_probs=false", alignment=None)
    )
    assert tc.metrics_enabled(verl_config(alignment="all"))
    assert not tc.metrics_enabled(verl_config(alignment=None))


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


# ----------------------------------------------------------------------------------------------
# install / uninstall on the real trainer modules
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def trainer_modules():
    v1 = importlib.import_module("verl.trainer.ppo.v1.trainer_base")
    legacy = importlib.import_module("verl.trainer.ppo.ray_trainer")
    for module in (v1, legacy):
        assert tc.install_trainer_callback(module)
    yield v1, legacy
    for module in (v1, legacy):  # leave them installed, as the plugin does on import
        assert tc.install_trainer_callback(module)


def test_install_is_idempotent_and_reversible(trainer_modules):
    v1, legacy = trainer_modules
    debug_mod = importlib.import_module("verl.utils.debug.metrics")
    for module in (legacy, v1):
        tc.uninstall_trainer_callback(module)
    original_debug = debug_mod.calculate_debug_metrics
    original_v1_fit, original_legacy_fit = v1.PPOTrainer.fit, legacy.RayPPOTrainer.fit
    original_v1_global = v1.calculate_debug_metrics
    assert not hasattr(original_debug, "__rlalign_original__")
    assert not tc.is_installed(v1) and not tc.is_installed(legacy)

    for _ in range(2):
        assert tc.install_trainer_callback(legacy) and tc.install_trainer_callback(v1)
    assert tc.is_installed(v1) and tc.is_installed(legacy)
    assert v1.PPOTrainer.fit.__rlalign_original__ is original_v1_fit  # wrapped once, not twice
    assert legacy.RayPPOTrainer.fit.__rlalign_original__ is original_legacy_fit
    assert debug_mod.calculate_debug_metrics.__rlalign_original__ is original_debug
    assert v1.calculate_debug_metrics.__rlalign_original__ is original_v1_global
    # Subclasses (the registered v1 trainers) inherit the wrapped fit.
    from verl.trainer.ppo.v1 import get_trainer_cls

    assert get_trainer_cls("sync").fit is v1.PPOTrainer.fit

    assert tc.uninstall_trainer_callback(v1) and tc.uninstall_trainer_callback(legacy)
    assert v1.PPOTrainer.fit is original_v1_fit and legacy.RayPPOTrainer.fit is original_legacy_fit
    assert debug_mod.calculate_debug_metrics is original_debug
    assert v1.calculate_debug_metrics is original_v1_global
    assert not tc.uninstall_trainer_callback(v1)


def test_install_refuses_unknown_module(warnings_log):
    assert not tc.install_trainer_callback(json)
    assert "not a verl trainer module" in warnings_log.text


def test_hook_is_inert_outside_a_wrapped_fit(trainer_modules):
    """Other callers of calculate_debug_metrics (no wrapped fit running) get verl's result unchanged."""
    data = step_tensors(5)
    data["old_log_probs"] = train_log_probs(data["rollout_log_probs"], 5)
    batch = DataProto.from_dict(data)
    debug_mod = importlib.import_module("verl.utils.debug.metrics")
    out = debug_mod.calculate_debug_metrics(batch)
    assert not any(k.startswith("mismatch/") for k in out)
    assert "training/rollout_probs_diff_mean" in out


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
