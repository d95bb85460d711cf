"""The library versions the aligned forwards are tested on, and the check ``validate`` runs against them.

transformers changes how decoder layers are called between minor versions (5.23: checkpointing through a
wrapper on the class's ``forward``; 5.24: the KV cache passed as ``cache=``), and an aligned forward that
misses such a change fails silently (no checkpointing, no KV cache writes). So a transformers outside the
tested range is refused in one line unless ``experimental.untested_versions`` opts in (then logged once).
The range is the ``transformers`` requirement in ``pyproject.toml`` (a test keeps the two equal).
"""

from __future__ import annotations

import importlib.metadata

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.base.log import visible_logger, warn_once
from rlalign_verl.base.options import key_name, key_setting

TRANSFORMERS_TESTED = ">=5.10,<5.25"
"""transformers versions the CI version matrix runs the patching, checkpointing and generation tests on."""


class UntestedVersionError(AlignmentError):
    """A library version outside the range the aligned forwards are tested on."""


def transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_transformers(opt_in: bool, version: str | None = None) -> None:
    """Refuse (or, opted in, log once) a transformers outside :data:`TRANSFORMERS_TESTED`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = version if version is not None else transformers_version()
    if found is None:
        return
    try:
        inside = Version(found) in SpecifierSet(TRANSFORMERS_TESTED)
    except InvalidVersion:
        inside = False
    if inside:
        return
    key = key_name("experimental.untested_versions")
    what = (
        f"transformers {found} is outside the range rlalign-verl's aligned forwards are tested on "
        f"({TRANSFORMERS_TESTED}); other versions may call decoder layers differently (checkpointing, KV cache)"
    )
    if not opt_in:
        raise UntestedVersionError(
            f"{what}; install 'transformers{TRANSFORMERS_TESTED}', or set "
            f"{key_setting('experimental.untested_versions', 'true')} to try anyway"
        )
    warn_once(visible_logger("rlalign_verl"), f"{what}; continuing because {key} is set")
