"""Keys are spelled once, at a surface's edge (rlalign_verl.base.options.spelled_as): the checks below it name
keys as that surface writes them, and the edge's setting ends with it."""

from __future__ import annotations

import pytest

from rlalign_verl.base.errors import ConfigFormatError
from rlalign_verl.base.options import key_name, spelled_as, surface
from rlalign_verl.request.checks import validate_request
from rlalign_verl.request.spec import AlignmentSpec


@pytest.mark.parametrize(
    ("spelling", "shown"),
    [("hydra", "alignment.verify.every=x"), ("flag", "--alignment.verify.every=x"), ("python", "every='x'")],
)
def test_each_edge_spells_the_key_its_way(spelling, shown):
    with pytest.raises(ConfigFormatError, match=f"^{shown.replace('.', '[.]')}: give an integer"):
        AlignmentSpec.parse({"regions": ["rope"], "verify": {"every": "x"}}, spelling=spelling)
    assert surface() == "hydra"  # the edge's spelling ended with the call, also on an error


def test_validate_request_follows_the_surface_already_set():
    spec = AlignmentSpec.parse(
        {"regions": ["rope"], "engine": "vllm-cpu", "experimental": {"compiled_norm": True}}
    )
    spec = spec.replace(regions=("rope",))
    with spelled_as("flag"), pytest.raises(Exception, match="^--alignment.experimental.compiled_norm true"):
        validate_request(spec)
    with pytest.raises(Exception, match="^compiled_norm=True"):
        validate_request(spec, spelling="python")
    assert key_name("engine") == "alignment.engine"


def test_an_unknown_spelling_is_refused():
    with pytest.raises(ValueError, match="use one of hydra, flag, python"), spelled_as("yaml"):
        pass
