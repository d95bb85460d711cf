"""The ``verl.plugins`` entry point (the plugin loads with verl, import-light) and the post-import hooks.

The worker side is tested in ``test_verl_model_hook.py`` (the per-model gate) and ``test_verl_fsdp_engine.py``
(verl's own FSDP engine on CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ENV = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")


def _run(code: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env or ENV,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


# --- plugin loading --------------------------------------------------------------------------------


@pytest.mark.verl
def test_import_verl_loads_plugin_through_entry_point():
    pytest.importorskip("verl")
    code = """
        import json, sys
        import verl
        from importlib.metadata import entry_points
        eps = [(ep.name, ep.value) for ep in entry_points(group="verl.plugins")]
        plugin = sys.modules.get("rlalign_verl.verl.plugin")
        import verl.utils.config as vc
        print(json.dumps({
            "eps": eps,
            "loaded": bool(plugin and plugin.LOADED),
            "validate_wrapped": getattr(vc.validate_config, "_rlalign_wrapped", False),
            "engine_imported": "verl.workers.engine" in sys.modules,
        }))
    """
    info = json.loads(_run(code).stdout.strip().splitlines()[-1])
    assert ["rlalign_verl", "rlalign_verl.verl.plugin"] in info["eps"]
    assert info["loaded"] is True
    assert info["validate_wrapped"] is True
    assert info["engine_imported"] is False  # the plugin must not resolve verl's platform early

    off = json.loads(
        _run(code, env=dict(ENV, VERL_USE_EXTERNAL_PLUGINS="none")).stdout.strip().splitlines()[-1]
    )
    assert off["loaded"] is False and off["validate_wrapped"] is False


def test_plugin_import_is_light():
    """Inference servers load the plugin too: it must not pull in torch, transformers or verl."""
    code = """
        import sys
        import rlalign_verl.verl.plugin as p
        heavy = [m for m in ("torch", "transformers", "verl", "omegaconf", "hydra") if m in sys.modules]
        print(p.LOADED, heavy)
    """
    assert _run(code).stdout.strip() == "True []"


# --- post-import hooks ------------------------------------------------------------------------------


def test_when_imported_fires_after_module_body(tmp_path, monkeypatch):
    from rlalign_verl.base.import_hooks import pending, when_imported

    pkg = tmp_path / "rlv_hook_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "target.py").write_text("VALUE = 41\ndef f():\n    return VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def bump(module):
        seen.append(module.__name__)
        module.VALUE += 1  # the module body has run: its globals exist

    when_imported("rlv_hook_pkg.target", bump)
    assert pending("rlv_hook_pkg.target")
    import importlib

    mod = importlib.import_module("rlv_hook_pkg.target")
    assert seen == ["rlv_hook_pkg.target"] and mod.f() == 42
    assert not pending("rlv_hook_pkg.target")
    assert mod.__spec__.loader.get_source("rlv_hook_pkg.target").startswith("VALUE = 41")
    # already imported: runs at once, and only for this registration
    when_imported("rlv_hook_pkg.target", bump)
    assert seen == ["rlv_hook_pkg.target"] * 2 and mod.f() == 43
    importlib.reload(mod)
    assert mod.f() == 41
    for name in ("rlv_hook_pkg.target", "rlv_hook_pkg"):
        sys.modules.pop(name, None)
