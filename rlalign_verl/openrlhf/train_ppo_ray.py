"""Launcher: OpenRLHF's ``train_ppo_ray`` with rlalign-verl installed in every Ray worker.

Usage (every flag that is not the plugin's goes to OpenRLHF unchanged)::

    python -m rlalign_verl.openrlhf.train_ppo_ray \\
        --alignment.regions rope,swiglu,rmsnorm --alignment.engine vllm \\
        [--alignment.metrics true] [--alignment.collect_rollout_logprobs true] [--address ADDR] \\
        <openrlhf.cli.train_ppo_ray flags>

On an existing cluster: ``ray job submit --address ... -- python -m rlalign_verl.openrlhf.train_ppo_ray ...``
(Ray sets ``RAY_ADDRESS`` for the job's driver) or pass ``--address``. rlalign-verl must be installed
on every node (the workers import :data:`~rlalign_verl.openrlhf.setup.HOOK`).

Steps: parse and validate the plugin's flags (bad input fails here, before Ray starts); ``ray.init`` with
the env vars OpenRLHF's ``train()`` would set plus the plugin's settings and the setup hook; run the
setup in the driver too; then execute ``openrlhf.cli.train_ppo_ray`` as ``__main__`` with the remaining
flags (its ``train()`` sees Ray initialised and keeps our runtime env).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from rlalign_verl.base.errors import exit_on_error
from rlalign_verl.openrlhf import settings as settings_mod
from rlalign_verl.openrlhf.log import logger, warn_once
from rlalign_verl.openrlhf.settings import (
    LaunchOptions,
    Settings,
    flag_value,
    parse_launcher_args,
    rollout_logprobs_requested,
)
from rlalign_verl.openrlhf.setup import HOOK, install

OPENRLHF_MODULE = "openrlhf.cli.train_ppo_ray"

# The env vars OpenRLHF's own train() passes to ray.init (user-set values win, as there).
OPENRLHF_ENV_DEFAULTS = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}


def runtime_env(settings: Settings) -> dict[str, Any]:
    """The job runtime env: OpenRLHF's env vars, the plugin's settings and the worker setup hook."""
    env_vars = {key: os.environ.get(key, default) for key, default in OPENRLHF_ENV_DEFAULTS.items()}
    env_vars.update(settings.to_env())  # incl. the resolved --alignment.unverified opt-in
    return {"worker_process_setup_hook": HOOK, "env_vars": env_vars}


def init_ray(settings: Settings, address: str | None = None, **ray_kwargs: Any) -> None:
    """Start (or connect to) Ray with the plugin's runtime env and install the plugin in this process.

    ``address``: an existing cluster; ``None`` lets Ray use ``RAY_ADDRESS`` or start a local one.
    """
    import ray

    os.environ.update(settings.to_env())  # the driver reads the same settings as the workers
    if ray.is_initialized():
        raise RuntimeError(
            "Ray is already initialised in this process without the plugin's runtime env; call "
            "init_ray() before anything else starts Ray"
        )
    env = runtime_env(settings)
    ray.init(address=address, runtime_env=env, **ray_kwargs)
    logger.info(
        "Ray initialised (address %s) with worker_process_setup_hook=%s",
        ray.get_runtime_context().gcs_address,
        env["worker_process_setup_hook"],
    )
    install(settings)


def _warn_about_rollout_logprobs(options: LaunchOptions) -> None:
    s = options.settings
    argv = options.openrlhf_argv
    engines = flag_value(argv, settings_mod.VLLM_ENGINES_FLAGS)
    needs = s.metrics or bool(s.regions)  # the metrics, and the in-run verification of an aligned run
    if needs and (engines is None or engines is True or str(engines).strip() in ("0", "")):
        warn_once(
            "no vLLM engines (--vllm.num_engines): there are no rollout log-probs, so no mismatch/* metrics "
            "and no in-run verification"
        )
    elif needs and not s.collect_rollout_logprobs and not rollout_logprobs_requested(argv):
        warn_once(
            "rollout log-probs are not collected (OpenRLHF's IS correction is off), so no mismatch/* metrics "
            "and no in-run verification; add --alignment.collect_rollout_logprobs true to measure without "
            "changing the loss"
        )


def _check_confounders(options: LaunchOptions) -> None:
    """OpenRLHF flags that make the gap something other than rounding: errors stop here, warnings are logged."""
    spec = options.settings.spec
    if not spec.doctor.enable:
        return
    from rlalign_verl.openrlhf.doctor_flags import check
    from rlalign_verl.request.regions import startup_lines

    collect = options.settings.collect_rollout_logprobs
    lines = check(options.openrlhf_argv, collect_rollout_logprobs=collect, allow=spec.doctor.allow)
    for line in lines + startup_lines(spec, "--alignment.regions"):
        logger.warning("doctor: %s", line)


def _print_help() -> None:
    print(
        "rlalign-verl options (the rest are openrlhf.cli.train_ppo_ray's, below):\n"
        + (settings_mod.__doc__ or "").split("\n\n", 1)[1]
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Run OpenRLHF's ``train_ppo_ray`` with the plugin. ``argv`` excludes the program name."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with exit_on_error(2):  # a bad setting: one "[rlalign-verl] ERROR ..." line, exit 2, before Ray starts
        if "-h" in argv or "--help" in argv:
            _print_help()
            # help needs no checkpoint: the request is checked, the model is not read
            options = parse_launcher_args([a for a in argv if a not in ("-h", "--help")], checkpoint=False)
            options.openrlhf_argv.append("--help")
        else:
            options = parse_launcher_args(argv)
            logger.info("%s (profile: %s)", options.settings.describe(), options.profile_reason)
            _warn_about_rollout_logprobs(options)
            _check_confounders(options)
            init_ray(options.settings, options.address)
    sys.argv = [OPENRLHF_MODULE.replace(".", "/") + ".py", *options.openrlhf_argv]
    runpy.run_module(OPENRLHF_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
