"""Hostile text and data in ``rlalign-verl report``: mathtext in user text, intervals that do not hold their
value, ``--tensorboard-layout`` given with a report's arguments, duplicate JSON keys. Each ends in a report
that says what it did, or a one-line refusal; never a traceback, never a silent loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
from report_runs import call

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlalign_verl.tools.report.page import PANELS, plot_panel, write_report  # noqa: E402
from rlalign_verl.tools.report.runs import Run, load_run  # noqa: E402

HEADLINE = "mismatch/logp_abs_diff_mean"
GAIN, LO, HI = "mismatch/verify/gain", "mismatch/verify/gain_lo", "mismatch/verify/gain_hi"
GAIN_PANEL = next(p for p in PANELS if p.name == "verify_gain")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _good(path: Path, steps: int = 3) -> Path:
    return _jsonl(path, [{"step": s, "data": {HEADLINE: 0.01 * s}} for s in range(1, steps + 1)])


def _ok(capsys: pytest.CaptureFixture[str], rc: int) -> str:
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "Traceback" not in err and "Error" not in err, err
    return err


def _one_line_error(capsys: pytest.CaptureFixture[str], rc: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("[rlalign-verl] ERROR ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    return err


# --- user text reaching matplotlib is drawn literally ------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("good.jsonl", ["--title", r"$\foo$"]),
        ("good.jsonl", ["--labels", r"a$\frac$"]),
        (r"run$\x$.jsonl", []),
        ("good.jsonl", ["--title", r"cost \$5, a $\alpha^$ b"]),
    ],
)
def test_mathtext_in_title_labels_and_file_names_is_no_traceback(tmp_path, capsys, name, extra):
    run = _good(tmp_path / name)
    out = tmp_path / "out"
    _ok(capsys, call(str(run), "--out", str(out), *extra))
    assert (out / "overview.png").is_file() and (out / "logp_gap.png").is_file()
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "$" in page  # the text on the page as given


@pytest.mark.parametrize("label", [r"a$\frac$", r"$x$", "_hidden", r"back\slash $$", "a\\$b"])
def test_a_run_label_is_shown_in_the_legend_as_given(label):
    run = Run(label, "x", "jsonl", {"mismatch/kl_k3": [(1, 0.1), (2, 0.2)]})
    panel = next(p for p in PANELS if p.name == "kl")
    fig, ax = plt.subplots()
    try:
        assert plot_panel(ax, panel, [run], ["C0"])
        fig.canvas.draw()  # mathtext would be parsed (and fail) here
        texts = ax.get_legend().get_texts()
        assert [t.get_text() for t in texts] == [label]  # a leading "_" is not dropped from the legend
        assert not any(t.get_parse_math() or t.get_usetex() for t in texts)
    finally:
        plt.close(fig)


def test_titles_are_literal_even_with_usetex_in_the_matplotlibrc(tmp_path):
    run = Run(r"r$\x$_1", "x", "jsonl", {HEADLINE: [(1, 0.1), (2, 0.2)]})
    with matplotlib.rc_context({"text.usetex": True}):  # no LaTeX is installed: it must not be asked for
        page = write_report([run], tmp_path / "out", title=r"$\foo$ 50% & #1")
    assert page.is_file() and (tmp_path / "out" / "logp_gap.png").is_file()


# --- 95% intervals that cannot be drawn around their value ------------------------------------------------


def _gain_rows(bad: dict) -> list[dict]:
    """Steps 1 and 3 with a good interval, step 2 with ``bad`` (the gain and interval logged there)."""
    good = {GAIN: 2.0, LO: 1.5, HI: 2.5}
    return [{"step": s, "data": {HEADLINE: 0.01, **(bad if s == 2 else good)}} for s in (1, 2, 3)]


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({GAIN: 1.5, LO: 2.0, HI: 3.0}, "gain 1.5 outside [2, 3]"),
        ({GAIN: 3.5, LO: 2.0, HI: 3.0}, "gain 3.5 outside [2, 3]"),
        ({GAIN: 2.5, LO: 3.0, HI: 2.0}, "interval [3, 2] reversed"),
        ({GAIN: 2.0, LO: 1.5}, "no usable gain_hi"),
        ({GAIN: 2.0, HI: 2.5}, "no usable gain_lo"),
        ({GAIN: None, LO: 1.5, HI: 2.5}, "no usable gain at that step"),
        ({LO: 1.5, HI: 2.5}, "no usable gain at that step"),
    ],
)
def test_an_interval_that_does_not_hold_its_gain_is_dropped_and_said(tmp_path, capsys, bad, why):
    path = _jsonl(tmp_path / "r.jsonl", _gain_rows(bad))
    run = load_run(path)
    (said,) = [p for p in run.problems if p.startswith(f"{GAIN}: 95% interval dropped at 1 step(s)")]
    assert f"step 2: {why}" in said, said
    assert [s for s, _ in run.series[LO]] == [1, 3] and [s for s, _ in run.series[HI]] == [1, 3]
    if bad.get(GAIN) is not None:
        assert (2, bad[GAIN]) in run.series[GAIN]  # the point stays, drawn without its interval
    err = _ok(capsys, call(str(path), "--out", str(tmp_path / "out")))
    assert why in err
    assert why in (tmp_path / "out" / "report.html").read_text(encoding="utf-8")


def test_a_step_relogged_without_its_interval_loses_the_interval_with_a_word(tmp_path, capsys):
    """A resumed run logs step 1 again with the gain only: the interval belongs to the other line."""
    rows = [
        {"step": 1, "data": {HEADLINE: 0.1, GAIN: 1.5, LO: 1.2, HI: 1.9}},
        {"step": 1, "data": {GAIN: 1.0}},
        {"step": 2, "data": {HEADLINE: 0.1, GAIN: 1.6, LO: 1.2, HI: 1.9}},
        {"step": 2, "data": {GAIN: 1.7}},  # inside the old interval, but not its own
    ]
    path = _jsonl(tmp_path / "band_dup.jsonl", rows)
    run = load_run(path)
    assert run.series[GAIN] == [(1, 1.0), (2, 1.7)] and LO not in run.series and HI not in run.series
    (said,) = [p for p in run.problems if p.startswith(f"{GAIN}: 95% interval dropped at 2 step(s)")]
    assert "step 1: gain logged 2×, gain_lo 1×, gain_hi 1×" in said, said
    _ok(capsys, call(str(path), "--out", str(tmp_path / "out")))
    assert (tmp_path / "out" / "verify_gain.png").is_file()


def test_a_run_built_in_python_with_a_bad_interval_is_drawn_and_said(tmp_path):
    series = {GAIN: [(1, 1.5), (2, 2.0)], LO: [(1, 2.0), (2, 1.5)], HI: [(1, 3.0), (2, 2.5)]}
    fig, ax = plt.subplots()
    try:  # plot_panel on its own draws only the intervals that hold their point
        assert plot_panel(
            ax, GAIN_PANEL, [Run("a", "x", "jsonl", {k: list(v) for k, v in series.items()})], ["C0"]
        )
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["a", "a · 95% interval"]
    finally:
        plt.close(fig)
    run = Run("a", "x", "jsonl", series)
    write_report([run], tmp_path / "out")
    assert run.series[LO] == [(2, 1.5)] and run.series[HI] == [(2, 2.5)]
    assert any("step 1: gain 1.5 outside [2, 3]" in p for p in run.problems), run.problems


def _events(directory: Path, steps: list[list[tuple[str, float]]]) -> Path:
    """An event file with one event per step (1, 2, ...) holding the ``(tag, value)`` pairs given."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    directory.mkdir(parents=True)
    with (directory / "events.out.tfevents.1.host").open("wb") as fh:
        writer = RecordWriter(fh)
        writer.write(event_pb2.Event(file_version="brain.Event:2").SerializeToString())
        for step, pairs in enumerate(steps, 1):
            values = [summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in pairs]
            writer.write(
                event_pb2.Event(step=step, summary=summary_pb2.Summary(value=values)).SerializeToString()
            )
    return directory


def test_a_tensorboard_interval_that_does_not_hold_its_gain_is_dropped_and_said(tmp_path):
    pytest.importorskip("tensorboard")
    steps = [
        [(HEADLINE, 0.01), (GAIN, g), (LO, lo), (HI, hi)] for g, lo, hi in [(2.0, 1.5, 2.5), (1.5, 2.0, 3.0)]
    ]
    run = load_run(_events(tmp_path / "tb", steps))
    assert [s for s, _ in run.series[LO]] == [1] and [s for s, _ in run.series[GAIN]] == [1, 2]
    assert any("step 2: gain 1.5 outside [2, 3]" in p for p in run.problems), run.problems


# --- --tensorboard-layout writes only the layout -----------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["RUN", "--out", "OUT"], "RUN/--out"),
        (["RUN"], "RUN"),
        (["--out", "OUT"], "--out"),
        (["--title", "t"], "--title"),
        (["--labels", "a"], "--labels"),
    ],
)
def test_tensorboard_layout_with_report_arguments_is_refused(tmp_path, capsys, extra, named):
    run, out, logs = _good(tmp_path / "r.jsonl"), tmp_path / "out", tmp_path / "logs"
    argv = [{"RUN": str(run), "OUT": str(out)}.get(a, a) for a in extra]
    rc = call(*argv, "--tensorboard-layout", str(logs))
    _one_line_error(
        capsys, rc, "--tensorboard-layout writes only the layout", named, "drop --tensorboard-layout"
    )
    assert not logs.exists() and not out.exists()  # refused before anything was written


def test_tensorboard_layout_alone_still_writes_the_layout(tmp_path, capsys):
    assert call("--tensorboard-layout", str(tmp_path / "logs")) == 0, capsys.readouterr().err
    assert [p.name.startswith("events.out.tfevents") for p in (tmp_path / "logs").iterdir()] == [True]


# --- duplicate JSON keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('{"step": 2, "step": 3, "data": {"mismatch/kl_k3": 0.1}}', "'step'"),
        ('{"step": 2, "data": {"mismatch/kl_k3": 0.1, "mismatch/kl_k3": 0.2}}', "'mismatch/kl_k3'"),
        ('{"step": 2, "data": {"x": 1}, "data": {"mismatch/kl_k3": 0.2}}', "'data'"),
        ('{"step": 2, "data": {"mismatch/kl_k3": 0.1, "n": {"a": 1, "a": 2}}}', "'a'"),
        ('{"step": 2, "data": {"mismatch/kl_k3": 0.1, "mismatch/kl_\\u006b3": 0.2}}', "'mismatch/kl_k3'"),
    ],
)
def test_a_line_with_a_duplicate_key_is_skipped_and_said(tmp_path, capsys, line, key):
    path = tmp_path / "r.jsonl"
    first, last = (
        '{"step": 1, "data": {"mismatch/kl_k3": 0.1}}',
        '{"step": 4, "data": {"mismatch/kl_k3": 0.4}}',
    )
    path.write_text(f"{first}\n{line}\n{last}\n", encoding="utf-8")
    run = load_run(path)
    assert run.series["mismatch/kl_k3"] == [(1, 0.1), (4, 0.4)]  # neither value of the line is guessed at
    expected = f"1 unreadable line(s) skipped: line 2 (key {key} given twice in one object)"
    assert expected in run.problems, run.problems
    err = _ok(capsys, call(str(path), "--out", str(tmp_path / "out")))
    assert expected in err


def test_a_file_of_duplicate_key_lines_only_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "dupkey.jsonl"
    path.write_text(
        '{"step":1,"data":{"mismatch/logp_abs_diff_mean":0.1,"mismatch/logp_abs_diff_mean":-5}}\n'
        '{"step":1,"step":2,"data":{"mismatch/kl_k3":0.1}}\n',
        encoding="utf-8",
    )
    rc = call(str(path), "--out", str(tmp_path / "out"))
    _one_line_error(capsys, rc, "no verl metrics lines", "line 2: key 'step' given twice in one object")
    assert not (tmp_path / "out").exists()


def test_a_tensorboard_tag_given_twice_in_one_event_is_said(tmp_path):
    """The TensorBoard counterpart of a duplicate key: one event holding a tag twice."""
    pytest.importorskip("tensorboard")
    run = load_run(_events(tmp_path / "tb", [[(HEADLINE, 0.25), (HEADLINE, 0.5)]]))
    assert run.series[HEADLINE] == [(1, 0.5)]
    assert any(p.startswith("step(s) 1 logged more than once") for p in run.problems), run.problems


def test_a_tensorboard_record_with_damaged_bytes_is_skipped_and_said(tmp_path):
    """A flipped bit inside a record's data (its length still intact): protobuf would parse it as another number;
    the record's data checksum says it is damaged, so its value is skipped and named, the others read."""
    import struct

    pytest.importorskip("tensorboard")
    directory = _events(tmp_path / "tb", [[(HEADLINE, 0.06 + 0.01 * s)] for s in range(5)])
    path = next(directory.iterdir())
    data = bytearray(path.read_bytes())
    value = struct.pack("<f", 0.06 + 0.01 * 2)  # step 3's float
    at = data.find(value)
    data[at + 3] ^= 0x40  # the exponent: 0.08 becomes ~2.7e37
    path.write_bytes(bytes(data))
    run = load_run(directory)
    assert [s for s, _ in run.series[HEADLINE]] == [1, 2, 4, 5]
    assert any("event file damaged" in p and "1 record(s)" in p for p in run.problems), run.problems


def test_cli_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    from rlalign_verl.tools.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"rlalign-verl {version('rlalign-verl')}"
    import rlalign_verl

    assert rlalign_verl.__version__ == version(
        "rlalign-verl"
    )  # pyproject.toml and the package say one version
