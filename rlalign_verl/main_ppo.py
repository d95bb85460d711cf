"""``python -m rlalign_verl.main_ppo <verl overrides> alignment.regions=[rope]``.

verl's PPO/GRPO entry point with our primary config (verl's ``ppo_trainer`` + the ``alignment``
group). The alignment settings are validated on the driver first; then verl's own ``main`` body runs
unchanged (device choice, verl's validation, ``run_ppo`` with verl's TaskRunner).
An alignment error is one ``[rlalign-verl] ERROR <Type>: <fix>`` line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import hydra
import verl  # noqa: F401 - as in verl's own entry point: loads verl's plugins and VERL_USE_EXTERNAL_MODULES first

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.verl.checks import check_override_spellings
from rlalign_verl.verl.config import validate_config
from rlalign_verl.verl.exit_line import one_line_errors


@hydra.main(config_path="pkg://rlalign_verl.configs", config_name="rlalign_ppo_trainer", version_base=None)
def main(config: Any) -> None:
    """Validate the alignment settings, then run verl's ``main_ppo.main`` on the same config.

    A bad setting ends the run with one ``[rlalign-verl] ERROR ...`` line and exit code 2 (no stack;
    ``HYDRA_FULL_ERROR=1`` shows the raw exception).
    """
    with one_line_errors():
        validate_config(config)
    from verl.trainer import main_ppo as verl_main_ppo

    # verl's hydra-decorated main; __wrapped__ is its plain body (functools.wraps in hydra.main).
    with one_line_errors(), alignment_error_from_ray():
        verl_main_ppo.main.__wrapped__(config)


@contextlib.contextmanager
def alignment_error_from_ray() -> Iterator[None]:
    """An alignment error raised inside verl's TaskRunner (e.g. in-run verification stopping the run) reaches
    the driver wrapped in Ray's ``RayTaskError``: unwrap it, so it ends the run as one line too."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised unless it wraps one of ours
        cause = getattr(err, "cause", None)
        if isinstance(cause, AlignmentError):
            raise cause from None
        raise


if __name__ == "__main__":
    import sys

    from rlalign_verl.base.errors import exit_on_error

    with exit_on_error(2):  # a moved key would otherwise be Hydra's "not in struct" error
        check_override_spellings(sys.argv[1:])
    main()
