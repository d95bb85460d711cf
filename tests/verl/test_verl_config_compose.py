"""The ``alignment`` config group composed on verl's real ``ppo_trainer`` config: both entry styles, ``--cfg job``."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from hydra import compose, initialize_config_module  # noqa: E402
from verl_configs import compose_ours, compose_verl, resolved, run_driver  # noqa: E402

from rlalign_verl.request.spec import RESOLVED_KEYS, AlignmentSpec  # noqa: E402

pytestmark = pytest.mark.verl


DEFAULTS = {k: v for k, v in AlignmentSpec().to_dict().items() if k not in RESOLVED_KEYS}
"""The group's defaults: the spec's defaults (the keys the driver adds when it resolves are not in the group)."""

REGION_CASES = [
    ("[rope]", ["rope"]),
    ("[rope,swiglu,rmsnorm]", ["rope", "swiglu", "rmsnorm"]),
    ("[]", []),
]


@pytest.mark.parametrize("composer", [compose_ours, compose_verl], ids=["ours", "verl"])
@pytest.mark.parametrize("regions_arg,expected", REGION_CASES, ids=["rope", "all", "none"])
def test_compose_reaches_actor_not_critic(composer, regions_arg, expected):
    cfg = resolved(composer(f"alignment.regions={regions_arg}", "actor_rollout_ref.rollout.name=vllm"))
    assert cfg["alignment"] == {**DEFAULTS, "regions": expected}
    override = cfg["actor_rollout_ref"]["model"]["override_config"]
    assert override == {"rlalign_spec": {**DEFAULTS, "regions": expected}}  # the driver replaces it, resolved
    assert cfg["critic"]["model"]["override_config"] == {}
    # verl's own keys are untouched by our group
    assert cfg["actor_rollout_ref"]["actor"]["strategy"] == "fsdp"
    assert cfg["algorithm"]["adv_estimator"] == "gae"


def test_compose_group_choices():
    assert resolved(compose_ours("alignment=rope"))["alignment"]["regions"] == ["rope"]
    cfg = resolved(compose_ours("alignment=all", "alignment.engine=sglang"))
    assert cfg["alignment"]["regions"] == ["rope", "swiglu", "rmsnorm"]
    assert cfg["actor_rollout_ref"]["model"]["override_config"]["rlalign_spec"]["engine"] == "sglang"
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(
            "ppo_trainer", overrides=["hydra.searchpath=[pkg://rlalign_verl.configs]", "+alignment=all"]
        )
    assert resolved(cfg)["actor_rollout_ref"]["model"]["override_config"]["rlalign_spec"]["regions"] == [
        "rope",
        "swiglu",
        "rmsnorm",
    ]


def test_verl_config_without_group_rejects_alignment_key():
    """What the group fixes: on verl's bare config the key is not in struct."""
    from hydra.errors import ConfigCompositionException

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        with pytest.raises(ConfigCompositionException):
            compose("ppo_trainer", overrides=["alignment.regions=[rope]"])


_CFG_JOB_DRIVER = """
import runpy, sys
for i, argv in enumerate({runs!r}):
    sys.argv = [argv[0] + ".py", *argv[1:], "--cfg", "job", "--resolve"]
    print(f"=== run {{i}} ===", flush=True)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    sys.stdout.flush()
"""


def _cfg_job_runs(runs: list[list[str]]) -> list[dict]:
    """``python -m <module> <args> --cfg job --resolve`` for each run, all in one fresh subprocess
    (``runpy.run_module(..., run_name="__main__")`` is what ``python -m`` does)."""
    import yaml

    out = run_driver(_CFG_JOB_DRIVER, runs)
    chunks = out.stdout.split("=== run ")[1:]
    assert len(chunks) == len(runs), out.stdout[-2000:]
    return [yaml.safe_load(chunk.split("\n", 1)[1]) for chunk in chunks]


def test_cfg_job_subprocess():
    """``--cfg job`` of both entry points (ours and verl's + our group) for each region setting."""
    runs, expected = [], []
    for regions_arg, want in REGION_CASES:
        common = [f"alignment.regions={regions_arg}", "actor_rollout_ref.rollout.name=vllm"]
        runs.append(["rlalign_verl.main_ppo", *common])
        runs.append(
            [
                "verl.trainer.main_ppo",
                "hydra.searchpath=[pkg://rlalign_verl.configs]",
                "+alignment=default",
                *common,
            ]
        )
        expected += [want, want]
    for cfg, want in zip(_cfg_job_runs(runs), expected, strict=True):
        assert cfg["alignment"] == {**DEFAULTS, "regions": want}
        assert cfg["actor_rollout_ref"]["model"]["override_config"] == {
            "rlalign_spec": {**DEFAULTS, "regions": want}
        }
        assert cfg["critic"]["model"]["override_config"] == {}
        assert cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm"
        assert cfg["algorithm"]["adv_estimator"] == "gae"
