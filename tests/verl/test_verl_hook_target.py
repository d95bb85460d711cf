"""A moved verl hook target is an error, in the worker and on the driver (no silent unaligned training)."""

from __future__ import annotations

import types

import pytest

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.verl import model_hook


def _engine_module(**members) -> types.ModuleType:
    mod = types.ModuleType("verl.workers.engine.fsdp.transformer_impl")
    mod.__dict__.update(members)
    return mod


@pytest.mark.parametrize(
    "members", [{}, {"FSDPEngine": type("FSDPEngine", (), {})}], ids=["no-class", "no-method"]
)
def test_worker_hook_raises_when_target_missing(members: dict) -> None:
    with pytest.raises(
        AlignmentError, match=r"FSDPEngine\._build_module is missing .* install verl==0\.9\.1"
    ):
        model_hook.wrap_fsdp_engine(_engine_module(**members))


def test_worker_hook_wraps_present_target_once() -> None:
    cls = type("FSDPEngine", (), {"_build_module": lambda self: "built"})
    mod = _engine_module(FSDPEngine=cls)
    model_hook.wrap_fsdp_engine(mod)
    wrapped = cls._build_module
    model_hook.wrap_fsdp_engine(mod)  # idempotent
    assert cls._build_module is wrapped and getattr(wrapped, "_rlalign_wrapped", False)


def _fake_verl(tmp_path, source: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "verl"
    (root / "workers" / "engine" / "fsdp").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    if source is not None:
        (root / "workers" / "engine" / "fsdp" / "transformer_impl.py").write_text(source)
    spec = types.SimpleNamespace(origin=str(root / "__init__.py"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: spec if name == "verl" else None)


@pytest.mark.parametrize(
    "source, ok",
    [
        ("class FSDPEngine:\n    def _build_module(self):\n        pass\n", True),
        ("class FSDPEngine:\n    def _build_model(self):\n        pass\n", False),
        ("class OtherEngine:\n    def _build_module(self):\n        pass\n", False),
        (None, False),
    ],
    ids=["present", "renamed-method", "renamed-class", "module-moved"],
)
def test_driver_check_reads_the_source(tmp_path, monkeypatch, source: str | None, ok: bool) -> None:
    _fake_verl(tmp_path, source, monkeypatch)
    if ok:
        model_hook.check_hook_target()
    else:
        with pytest.raises(AlignmentError, match="alignment.regions=\\[\\]"):
            model_hook.check_hook_target()


def test_driver_check_passes_on_installed_verl() -> None:
    pytest.importorskip("verl")
    model_hook.check_hook_target()
