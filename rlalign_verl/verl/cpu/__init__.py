"""Run verl 0.9.1 + the vLLM CPU engine on a CPU-only machine (opt-in: ``RLALIGN_VERL_CPU=1``).

Not part of the GPU worker path: the plugin installs these only when the variable is set, in every
verl process (driver, TaskRunner, FSDP workers, vLLM server and its worker, agent loop), through the
same ``verl.plugins`` entry point. The adaptations are listed with reasons and upstream locations in
:data:`.table.ADAPTATIONS`; nothing heavy is imported until verl imports the patched modules.
"""

from __future__ import annotations

import os

ENV_FLAG = "RLALIGN_VERL_CPU"

_installed: list[str] = []


def enabled() -> bool:
    """Whether ``RLALIGN_VERL_CPU`` asks for the CPU adaptations in this process."""
    return os.environ.get(ENV_FLAG, "").strip().lower() in ("1", "true", "yes", "on")


def install() -> list[str]:
    """Register the post-import hook of every adaptation whose version gate holds; return their names.

    Idempotent. Also selects the CPU platform for this process and its children (``VERL_PLATFORM``).
    """
    if _installed:
        return list(_installed)
    from rlalign_verl.base.import_hooks import when_imported
    from rlalign_verl.verl.cpu.fixes import set_process_env
    from rlalign_verl.verl.cpu.table import ADAPTATIONS, gate_holds
    from rlalign_verl.verl.log import logger

    set_process_env()
    for adaptation in ADAPTATIONS:
        ok, why = gate_holds(adaptation)
        if not ok:
            logger.info("CPU adaptation %s skipped: %s", adaptation.name, why)
            continue
        when_imported(adaptation.module, adaptation.apply)
        for module, check in adaptation.checks:
            when_imported(module, check)
        _installed.append(adaptation.name)
    return list(_installed)
