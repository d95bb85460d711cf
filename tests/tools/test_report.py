"""``rlalign-verl report`` on logs written by verl's real Tracking backends (file JSONL, TensorBoard)."""

from __future__ import annotations

import base64
import math
from html.parser import HTMLParser

import pytest
from report_runs import call, write_file_run, write_tensorboard_run

from rlalign_verl.tools.report.runs import load_run

pytest.importorskip("verl.utils.tracking")
pytest.importorskip("tensorboard")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_data(self, data):
        self.text.append(data)


@pytest.mark.slow
def test_report_compares_jsonl_and_tensorboard_runs(tmp_path, monkeypatch, capsys):
    import matplotlib.image

    baseline = write_file_run(tmp_path / "baseline.jsonl", monkeypatch, gap=0.02)
    rope = write_tensorboard_run(tmp_path / "tb" / "rope", monkeypatch, gap=0.01)
    run_dir = tmp_path / "all_regions_dir"
    run_dir.mkdir()
    write_file_run(run_dir / "metrics.jsonl", monkeypatch, gap=0.002, with_training=False)
    out = tmp_path / "out"

    rc = call(str(baseline), str(rope), str(run_dir), "--out", str(out), "--labels", "baseline,rope,all")
    assert rc == 0, capsys.readouterr().err
    names = [
        "overview",
        "logp_gap",
        "verify_gap",
        "verify_gain",
        "kl",
        "ratio_extremes",
        "clip_frac",
        "seq_log_ratio",
        "reward",
        "entropy",
        "grad_norm",
    ]
    for name in names:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
        assert image.std() > 0.01  # not a blank canvas

    parser = _Images()
    page = (out / "report.html").read_text(encoding="utf-8")
    parser.feed(page)
    assert len(parser.images) == len(names)
    embedded = {base64.b64decode(src.split(",", 1)[1]) for src in parser.images}
    assert all(src.startswith("data:image/png;base64,") for src in parser.images)
    assert embedded == {(out / f"{name}.png").read_bytes() for name in names}  # each plot, self-contained
    text = " ".join(parser.text)
    for label in ("baseline", "rope", "all"):
        assert label in text
    assert "tensorboard" in text and "jsonl" in text
    assert "wrote" in capsys.readouterr().out


def test_load_run_reads_both_formats(tmp_path, monkeypatch):
    jsonl = load_run(write_file_run(tmp_path / "a.jsonl", monkeypatch, gap=0.02))
    tb = load_run(write_tensorboard_run(tmp_path / "tb", monkeypatch, gap=0.02))
    assert jsonl.kind == "jsonl" and tb.kind == "tensorboard"
    assert jsonl.label == "a" and tb.label == "tb"
    want = [(s, 0.02 * (1 + 0.1 * s)) for s in range(1, 7)]
    for run_ in (jsonl, tb):
        got = run_.series["mismatch/logp_abs_diff_mean"]
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # TB stores float32
    # The NaN step (null in JSON) and the text value are skipped.
    assert [s for s, _ in jsonl.series["mismatch/kl_k3"]] == [1, 2, 4, 5, 6]
    assert "note" not in jsonl.series
    assert all(math.isfinite(v) for pts in jsonl.series.values() for _, v in pts)


def test_resumed_jsonl_keeps_the_last_value_per_step(tmp_path):
    path = tmp_path / "resumed.jsonl"
    path.write_text(
        '{"step": 1, "data": {"mismatch/kl_k3": 0.5}}\n'
        "not json\n"
        '{"step": 2, "data": {"mismatch/kl_k3": 0.25}}\n'
        '{"step": 2, "data": {"mismatch/kl_k3": 0.125}}\n'
    )
    assert load_run(path).series["mismatch/kl_k3"] == [(1, 0.5), (2, 0.125)]


@pytest.mark.parametrize(
    "setup, words",
    [
        ("missing", "does not exist"),
        ("empty dir", "no verl metrics"),
        ("empty file", "no verl metrics lines"),
        ("two jsonl", "several JSONL files"),
        ("no known keys", "none of the runs has a metric to plot"),
        ("labels", "--labels has 1 names for 2 runs"),
    ],
)
def test_bad_input_gives_clear_error(tmp_path, capsys, setup, words):
    target = tmp_path / "run"
    runs = [str(target)]
    extra: list[str] = []
    if setup == "empty dir":
        target.mkdir()
    elif setup == "empty file":
        target = tmp_path / "run.jsonl"
        target.write_text("")
        runs = [str(target)]
    elif setup == "two jsonl":
        target.mkdir()
        for name in ("a", "b"):
            (target / f"{name}.jsonl").write_text('{"step": 1, "data": {"mismatch/kl_k3": 0.1}}\n')
    elif setup == "no known keys":
        target = tmp_path / "other.jsonl"
        target.write_text('{"step": 1, "data": {"timing_s/step": 3.0}}\n')
        runs = [str(target)]
    elif setup == "labels":
        target = tmp_path / "ok.jsonl"
        target.write_text('{"step": 1, "data": {"mismatch/kl_k3": 0.1}}\n')
        runs = [str(target), str(target)]
        extra = ["--labels", "only-one"]
    rc = call(*runs, "--out", str(tmp_path / "out"), *extra)
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("[rlalign-verl] ERROR AlignmentError: ") and words in err and err.count("\n") == 1


@pytest.mark.slow
def test_impossible_values_and_truncated_event_files_are_said(tmp_path, monkeypatch, capsys):
    """Bad data is dropped and named on stderr and on the page, never plotted silently."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"step": 1, "data": {"mismatch/logp_abs_diff_mean": 0.02, "mismatch/ratio_clip_frac": 0.1}}\n'
        '{"step": 2, "data": {"mismatch/logp_abs_diff_mean": -0.3, "mismatch/ratio_clip_frac": 1.5}}\n'
        '{"step": 3, "data": {"mismatch/logp_abs_diff_mean": 0.02, "mismatch/verify/verdict": 0.5}}\n'
    )
    tb = write_tensorboard_run(tmp_path / "tb", monkeypatch, gap=0.02, steps=6)
    events = next(tb.rglob("events.out.tfevents*"))
    events.write_bytes(events.read_bytes()[: events.stat().st_size * 2 // 3])  # a writer killed mid-file
    out = tmp_path / "out"
    assert call(str(bad), str(tb), "--out", str(out)) == 0
    err = capsys.readouterr().err
    assert "mismatch/logp_abs_diff_mean: dropped step(s) 2 (-0.3: negative, but it cannot be)" in err
    assert "mismatch/ratio_clip_frac: dropped step(s) 2 (1.5: a fraction outside [0, 1])" in err
    assert "mismatch/verify/verdict: dropped step(s) 3 (0.5: not a verdict" in err
    assert "event file truncated" in err and "the steps written after it are missing" in err
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "Data problems" in page and "event file truncated" in page
    assert load_run(bad).series["mismatch/logp_abs_diff_mean"] == [(1, 0.02), (3, 0.02)]
    kept = load_run(tb).series["mismatch/logp_abs_diff_mean"]
    assert 0 < len(kept) < 6  # the readable prefix only


def test_tensorboard_layout_groups_the_mismatch_keys(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import metadata

    assert call("--tensorboard-layout", str(tmp_path / "logs")) == 0
    acc = EventAccumulator(str(tmp_path / "logs"))
    acc.Reload()
    from tensorboard.plugins.custom_scalar import layout_pb2

    assert metadata.CONFIG_SUMMARY_TAG in acc.PluginTagToContent(metadata.PLUGIN_NAME)
    (event,) = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)  # what TensorBoard's custom-scalars plugin reads
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    tags = {t for c in layout.category for chart in c.chart for t in chart.multiline.tag}
    assert "^mismatch/logp_abs_diff_mean$" in tags and "^mismatch/verify/gain$" in tags
    assert [c.title for c in layout.category][0].startswith("mismatch: the gap")
