"""Which OpenRLHF hooks the plugin installs for a run's settings (no OpenRLHF needed: the hooks are registered
for when OpenRLHF's modules are imported)."""

from __future__ import annotations

import pytest

from rlalign_verl.openrlhf import setup
from rlalign_verl.openrlhf.settings import Settings
from rlalign_verl.request.spec import AlignmentSpec

EXPERIENCE = "openrlhf.trainer.ppo_utils.experience_maker"
ACTOR = "openrlhf.models.actor"


def _hooks(monkeypatch: pytest.MonkeyPatch, **spec: object) -> set[str]:
    registered: list[str] = []
    monkeypatch.setattr(setup, "when_imported", lambda name, fn: registered.append(name))
    settings = Settings(AlignmentSpec.parse(dict(spec, engine="vllm")))
    try:
        setup.install(settings)
    finally:
        setup._active = None
    return set(registered)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"regions": ["rope"]}, {ACTOR, EXPERIENCE}),
        # metrics off: an aligned run still verifies itself (the experience hook carries both)
        ({"regions": ["rope"], "metrics": False}, {ACTOR, EXPERIENCE}),
        ({"regions": [], "metrics": True}, {EXPERIENCE}),  # a baseline run's dashboard
        ({"regions": [], "metrics": False}, set()),
    ],
)
def test_hooks_follow_the_settings(monkeypatch: pytest.MonkeyPatch, spec: dict, expected: set[str]) -> None:
    assert _hooks(monkeypatch, **spec) == expected
