"""Hostile inputs of ``rlalign-verl report``: malformed values, encodings, empty and clashing runs, odd
TensorBoard directories. Nothing is dropped without a word and nothing ends in a traceback.

The output side (links, unwritable targets) is in ``test_report_targets.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from report_runs import call

from rlalign_verl.tools.report.runs import load_run

HEADLINE = "mismatch/logp_abs_diff_mean"


def _jsonl(path: Path, rows: list[dict], encoding: str = "utf-8", bom: bool = False) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_bytes(("\ufeff" if bom else "").encode(encoding) + text.encode(encoding))
    return path


def _rows(n: int = 3, **extra: object) -> list[dict]:
    return [{"step": s, "data": {HEADLINE: 0.01 * s, **extra}} for s in range(1, n + 1)]


def _one_line_error(capsys: pytest.CaptureFixture[str], rc: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("[rlalign-verl] ERROR ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, err
    return err


# --- malformed values ------------------------------------------------------------------------------------


def test_numeric_strings_are_read_as_numbers_and_said(tmp_path):
    path = _jsonl(tmp_path / "r.jsonl", [{"step": s, "data": {HEADLINE: str(0.05 * s)}} for s in (1, 2)])
    run = load_run(path)
    assert run.series[HEADLINE] == [(1, 0.05), (2, 0.1)]
    said = [p for p in run.problems if "logged as text" in p]
    assert said and HEADLINE in said[0] and "'0.05' at step 1" in said[0], run.problems


def test_non_numeric_values_are_counted_per_key(tmp_path):
    rows = _rows(3)
    rows[1]["data"][HEADLINE] = "abc"
    rows[2]["data"][HEADLINE] = [0.1]
    rows[0]["data"]["flag"] = True
    run = load_run(_jsonl(tmp_path / "r.jsonl", rows))
    assert run.series[HEADLINE] == [(1, 0.01)]
    (said,) = [p for p in run.problems if "non-numeric" in p]
    assert (
        said.startswith("3 non-numeric value(s) skipped: ") and f"{HEADLINE} ×2" in said and "flag ×1" in said
    )
    assert "'abc' at step 2" in said


def test_text_nan_and_null_are_dropped_with_their_step(tmp_path):
    rows = _rows(3)
    rows[1]["data"][HEADLINE] = "nan"
    rows[2]["data"][HEADLINE] = None  # verl's file logger (orjson) writes NaN and inf as null
    run = load_run(_jsonl(tmp_path / "r.jsonl", rows))
    assert run.series[HEADLINE] == [(1, 0.01)]
    assert any(p.startswith(f"{HEADLINE}: dropped step(s) 2 (nan: not finite), 3") for p in run.problems), (
        run.problems
    )


def test_out_of_range_numbers_and_steps_are_no_traceback(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(
        f'{{"step": 1, "data": {{"{HEADLINE}": 1{"0" * 400}}}}}\n'  # an integer beyond float range
        f'{{"step": 1e400, "data": {{"{HEADLINE}": 0.1}}}}\n'  # an infinite step
        f'{{"step": 2.5, "data": {{"{HEADLINE}": 0.1}}}}\n'  # not a whole step: was read as step 2
        f'{{"step": 3, "data": {{"{HEADLINE}": 0.3}}}}\n' + "[" * 100_000 + "\n"  # nested past recursion
    )
    run = load_run(path)
    assert run.series[HEADLINE] == [(3, 0.3)]
    text = " | ".join(run.problems)
    assert "dropped step(s) 1 (inf: not finite)" in text
    assert "3 unreadable line(s) skipped: line 2 (step inf is not a whole number from 0 to 1e+09)" in text
    assert "line 3 (step 2.5 is not a whole number" in text and "line 5 (not JSON)" in text


@pytest.mark.parametrize("step", ['"1_0"', '"\u0661"', "-2", "1e300", '"-1"', "1000000001", '" 7x"'])
def test_a_step_verl_would_not_write_is_named_not_read(tmp_path, step):
    """int() reads "1_0" as 10 and Arabic-Indic digits as numbers; a 1e300 step would squash the step axis."""
    path = tmp_path / "r.jsonl"
    path.write_text(
        f'{{"step": 1, "data": {{"{HEADLINE}": 0.1}}}}\n{{"step": {step}, "data": {{"{HEADLINE}": 0.2}}}}\n'
    )
    run = load_run(path)
    assert run.series[HEADLINE] == [(1, 0.1)]
    assert any("line 2 (step" in p and "is not a whole number from 0 to 1e+09" in p for p in run.problems), (
        run.problems
    )


def test_a_line_separator_inside_a_string_does_not_split_the_line(tmp_path):
    rows = _rows(2, note="a\u2028b\x85c")
    run = load_run(_jsonl(tmp_path / "r.jsonl", rows))
    assert run.series[HEADLINE] == [(1, 0.01), (2, 0.02)]
    assert not any("unreadable" in p for p in run.problems), run.problems


def test_only_a_last_line_cut_short_is_blamed_on_truncation(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [json.dumps(r) for r in _rows(3)]
    path.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n" + lines[2] + "\n")
    run = load_run(path)
    (said,) = [p for p in run.problems if "unreadable" in p]
    assert said == "1 unreadable line(s) skipped: line 2 (not JSON)" and "trunc" not in said
    path.write_text("\n".join(lines) + "\n" + lines[0][:20])
    run = load_run(path)
    assert any(p.startswith("the last line (4) is cut short") for p in run.problems), run.problems


def test_all_values_unusable_names_why_in_the_error(tmp_path, capsys):
    path = _jsonl(tmp_path / "r.jsonl", [{"step": 1, "data": {HEADLINE: "abc"}}])
    rc = call(str(path), "--out", str(tmp_path / "out"))
    _one_line_error(capsys, rc, "no numeric metrics found", "non-numeric", HEADLINE)
    assert not (tmp_path / "out").exists()


# --- encodings -------------------------------------------------------------------------------------------


def test_utf8_bom_keeps_the_first_line(tmp_path):
    run = load_run(_jsonl(tmp_path / "r.jsonl", _rows(3), bom=True))
    assert [s for s, _ in run.series[HEADLINE]] == [1, 2, 3]
    assert not any("unreadable" in p or "trunc" in p for p in run.problems), run.problems


def test_concatenated_files_with_a_bom_each(tmp_path):
    first = _jsonl(tmp_path / "a.jsonl", _rows(2), bom=True).read_bytes()
    second = _jsonl(tmp_path / "b.jsonl", [{"step": 3, "data": {HEADLINE: 0.03}}], bom=True).read_bytes()
    (tmp_path / "c.jsonl").write_bytes(first + second)
    run = load_run(tmp_path / "c.jsonl")
    assert [s for s, _ in run.series[HEADLINE]] == [1, 2, 3] and not run.problems


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_utf16_and_utf32_with_a_bom_are_read(tmp_path, encoding):
    path = tmp_path / "r.jsonl"
    path.write_bytes("".join(json.dumps(r) + "\r\n" for r in _rows(3)).encode(encoding))  # BOM included
    run = load_run(path)
    assert [s for s, _ in run.series[HEADLINE]] == [1, 2, 3] and not run.problems


def test_a_latin1_byte_loses_no_metric_and_is_said(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [json.dumps(r).encode() for r in _rows(2)]
    lines[1] = lines[1][:-1] + b', "note": "caf\xe9"}'  # Latin-1 text in a value
    path.write_bytes(b"\n".join(lines) + b"\n")
    run = load_run(path)
    assert run.series[HEADLINE] == [(1, 0.01), (2, 0.02)]
    assert any(p.startswith("line(s) 2 hold bytes that are not UTF-8") for p in run.problems), run.problems


# --- empty and clashing runs -----------------------------------------------------------------------------


def test_a_run_without_mismatch_metrics_gets_a_remark_on_page_and_stderr(tmp_path, capsys):
    path = _jsonl(
        tmp_path / "plain.jsonl", [{"step": s, "data": {"critic/score/mean": 0.1 * s}} for s in (1, 2)]
    )
    out = tmp_path / "out"
    assert call(str(path), "--out", str(out)) == 0
    err = capsys.readouterr().err
    remark = "no mismatch/* metrics in this run: was alignment.metrics on"
    assert f"WARNING plain: {remark}" in err
    assert remark in (out / "report.html").read_text(encoding="utf-8")


def test_mismatch_keys_with_no_usable_value_get_their_own_remark(tmp_path):
    rows = [{"step": s, "data": {"critic/score/mean": 0.1, HEADLINE: -1.0}} for s in (1, 2)]
    run = load_run(_jsonl(tmp_path / "r.jsonl", rows))
    assert HEADLINE not in run.series
    assert run.problems[-1].startswith("no usable mismatch/* value in this run"), run.problems


def test_runs_with_one_default_name_are_told_apart(tmp_path, capsys):
    for parent in ("a", "b"):
        (tmp_path / parent / "exp").mkdir(parents=True)
        _jsonl(tmp_path / parent / "exp" / "metrics.jsonl", _rows(2))
    out = tmp_path / "out"
    assert call(str(tmp_path / "a" / "exp"), str(tmp_path / "b" / "exp"), "--out", str(out)) == 0
    err = capsys.readouterr().err
    assert "WARNING exp (2): another run is also named 'exp'" in err
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "<td>exp</td>" in page and "<td>exp (2)</td>" in page


def test_one_label_given_twice_is_refused(tmp_path, capsys):
    a, b = _jsonl(tmp_path / "a.jsonl", _rows(2)), _jsonl(tmp_path / "b.jsonl", _rows(2))
    rc = call(str(a), str(b), "--out", str(tmp_path / "out"), "--labels", "x,x")
    _one_line_error(capsys, rc, "--labels names x more than once")
    assert not (tmp_path / "out").exists()


def test_an_empty_out_is_not_the_current_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = call(str(_jsonl(tmp_path / "a.jsonl", _rows(2))), "--out", "")
    _one_line_error(capsys, rc, "--out is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


# --- TensorBoard directories -----------------------------------------------------------------------------


def _events(path: Path, values: list[tuple[int, object]]) -> Path:
    """An event file of ``(step, Summary.Value)`` records, written with TensorBoard's own framing."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        writer = RecordWriter(fh)
        writer.write(event_pb2.Event(file_version="brain.Event:2").SerializeToString())
        for step, value in values:
            event = event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value]))
            writer.write(event.SerializeToString())
    return path


def _simple(tag: str, number: float) -> object:
    from tensorboard.compat.proto import summary_pb2

    return summary_pb2.Summary.Value(tag=tag, simple_value=number)


def _tensor(tag: str, array: object) -> object:
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.util import tensor_util

    value = summary_pb2.Summary.Value(tag=tag, tensor=tensor_util.make_tensor_proto(array))
    value.metadata.plugin_data.plugin_name = "scalars"
    return value


def test_tensorboard_non_scalar_tensors_are_counted_not_a_traceback(tmp_path):
    pytest.importorskip("tensorboard")
    import numpy as np

    values = [(1, _simple(HEADLINE, 0.01)), (2, _tensor(HEADLINE, np.array([0.1, 0.2], dtype=np.float32)))]
    values.append((3, _tensor(HEADLINE, np.array(0.03, dtype=np.float32))))
    _events(tmp_path / "tb" / "events.out.tfevents.1.host", values)
    run = load_run(tmp_path / "tb")
    assert [s for s, _ in run.series[HEADLINE]] == [1, 3] and math.isclose(
        run.series[HEADLINE][1][1], 0.03, rel_tol=1e-6
    )
    assert any(p.startswith("1 non-numeric value(s) under scalar tags skipped") for p in run.problems), (
        run.problems
    )


def test_tensorboard_oddities_in_the_run_directory(tmp_path):
    """A directory named like an event file, and the layout file ``--tensorboard-layout`` wrote at the
    log root next to the run's own directory: neither is a run."""
    pytest.importorskip("tensorboard")
    root = tmp_path / "tensorboard_log"
    run_dir = root / "exp"
    _events(run_dir / "events.out.tfevents.1.host", [(1, _simple(HEADLINE, 0.01))])
    (run_dir / "events.out.tfevents.2.host").mkdir()
    assert call("--tensorboard-layout", str(root)) == 0
    run = load_run(root)
    assert run.kind == "tensorboard" and run.series[HEADLINE] == [(1, pytest.approx(0.01))]


def test_garbage_in_an_event_file_is_said(tmp_path):
    pytest.importorskip("tensorboard")
    path = _events(tmp_path / "tb" / "events.out.tfevents.1.host", [(1, _simple(HEADLINE, 0.01))])
    path.write_bytes(path.read_bytes() + b"\x05" + b"\x00" * 7 + b"junkjunk" + b"x" * 5)  # a bad length CRC
    run = load_run(tmp_path / "tb")
    assert run.series[HEADLINE] == [(1, pytest.approx(0.01))]
    assert any("21 bytes unread" in p for p in run.problems), run.problems
