"""The HTML report as a user opens it: headless Chromium loads it without errors and shows every plot.

The screenshot is kept as an artifact (``$RLALIGN_TEST_ARTIFACTS``, default ``test-artifacts/``). Without
a ``chromium`` executable the test skips, unless ``RLALIGN_REQUIRE_BROWSER=1`` (CI sets it) makes that a
failure. The report of the real GRPO run is rendered the same way in ``test_grpo_cpu.py``.
"""

from __future__ import annotations

import pytest
from browser import artifacts_dir, check_rendered, need_browser, render

pytestmark = pytest.mark.slow  # the edit-loop tier leaves it out (pyproject markers)


def test_report_renders_in_chromium(tmp_path, monkeypatch):
    need_browser()
    from report_runs import call, write_file_run, write_tensorboard_run

    write_file_run(tmp_path / "baseline.jsonl", monkeypatch, gap=0.02)
    write_tensorboard_run(tmp_path / "tb" / "all", monkeypatch, gap=0.005)
    out = tmp_path / "report"
    assert call(str(tmp_path / "baseline.jsonl"), str(tmp_path / "tb" / "all"), "--out", str(out)) == 0
    shot = artifacts_dir() / "report_synthetic.png"
    seen = render(out / "report.html", shot)
    assert seen.title == "rlalign-verl mismatch report"
    captions = ["Train-vs-rollout log-prob gap", "Verification gain = unaligned / aligned (95% interval)"]
    check_rendered(seen, shot, images=11, captions=captions)  # 10 panels drawn for these runs + the overview


def test_a_broken_page_is_caught(tmp_path):
    """The check itself can fail: a missing image and a script error are both reported."""
    need_browser()
    page = tmp_path / "broken.html"
    page.write_text('<html><body><img src="missing.png"><script>undefined_name()</script></body></html>')
    seen = render(page, tmp_path / "broken.png")
    assert any("missing.png" in e or "ERR_FILE_NOT_FOUND" in e for e in seen.errors), seen.errors
    assert any("undefined_name" in e for e in seen.errors), seen.errors
    assert seen.images[0]["width"] == 0
