"""The profile table in docs/engine-profiles.md is the one rendered from profiles.py."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from rlalign_verl.catalog.profiles import PROFILES, NormRounding, Residual, Source
from rlalign_verl.tools import profile_table

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "profile_table_script", ROOT / "scripts" / "profile_table.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_documents_match_the_profiles():
    assert _script().stale() == [], "run: python scripts/profile_table.py --write"


def test_check_fails_on_a_stale_document(tmp_path):
    doc = tmp_path / "doc.md"
    stale_table = profile_table.render().replace("fp32 table", "bf16 table")
    doc.write_text(f"intro\n{stale_table}\noutro\n")
    assert _script().stale((doc,)) == [doc]
    doc.write_text(profile_table.replace_block(doc.read_text(), profile_table.render()))
    assert _script().stale((doc,)) == []


def test_cells_follow_the_fields(monkeypatch):
    """Each cell is computed from the data: changing a field changes the rendered row."""
    p = PROFILES["vllm-eager"]
    assert profile_table.norm_cell(p) == "residual `R(s)` stored; `R(R(s)·rt(R(s))·w)`, sum/N"
    q = dataclasses.replace(
        p, norm=NormRounding(Source.FP32_SUM, Source.FP32_SUM, output_roundings=2), residual=Residual.NEVER
    )
    assert profile_table.norm_cell(q) == "`R(R(s·rt(s))·w)`, mean"
    assert profile_table.stream_cell(q) == "fp32 across all layers"
    monkeypatch.setitem(PROFILES, "vllm-eager", q)
    assert "`R(R(s·rt(s))·w)`, mean" in profile_table.render()


def test_replace_block_needs_markers():
    with pytest.raises(ValueError, match="begin/end markers"):
        profile_table.replace_block("no table here", profile_table.render())


def test_the_tp_cell_follows_the_reduction_fields():
    from rlalign_verl.catalog.profiles import get_profile
    from rlalign_verl.catalog.profiles_tp import TpReduction, reduction

    cpu = profile_table.tp_cell(reduction(get_profile("vllm-cpu")))
    assert cpu.startswith("fp32 sum, one rounding (from each rank's own partial)")
    assert "TP 2; verified at TP 2" in cpu
    hops = TpReduction(
        accumulate="bf16", order="rank", store="nearest", sizes=(2, 4, 6, 8), beyond="", fused_norm="x"
    )
    cell = profile_table.tp_cell(hops)
    assert (
        cell
        == "bf16, a rounding per add (ranks 0..N-1); TP 2, 4, 6, 8; fused all-reduce + norm not modelled; UNVERIFIED"
    )
    assert profile_table.tp_cell(reduction(get_profile("hf"))) == "no tensor parallelism"
    # the rendered vllm-cpu row reads the engine's reduction
    assert "; TP 2; verified at TP 2 |" in profile_table.render()
