"""TensorBoard event files: read scalars record by record (noticing a truncated file), and write the
custom-scalars layout that groups the ``mismatch/*`` keys on TensorBoard's "Custom Scalars" tab.

An event file is a sequence of TFRecords: ``uint64 length | uint32 masked crc32c(length) | data |
uint32 masked crc32c(data)``. TensorBoard's own loader stops quietly at a partial last record (a writer killed
mid-write): :func:`read_scalars` reads the framing itself and reports how many bytes were left unread.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AlignmentError

LAYOUT_GROUPS: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    (
        "mismatch: the gap (watch it)",
        (
            ("|Δ log p| mean and p99 (nats)", ("mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_p99")),
            ("KL(rollout ‖ train), k3 (nats/token)", ("mismatch/kl_k3",)),
        ),
    ),
    (
        "mismatch: importance ratio",
        (
            ("ratio extremes", ("mismatch/ratio_max", "mismatch/ratio_min")),
            ("tokens outside the PPO clip range", ("mismatch/ratio_clip_frac",)),
        ),
    ),
    (
        "mismatch: in-run verification (aligned vs unaligned, same tokens)",
        (
            ("|Δ log p|: aligned vs unaligned", ("mismatch/verify/aligned", "mismatch/verify/unaligned")),
            ("gain = unaligned / aligned (> 1: alignment helps)", ("mismatch/verify/gain",)),
            ("verdict (+1 better, 0 within noise, -1 worse)", ("mismatch/verify/verdict",)),
        ),
    ),
    (
        "collapse signature (verl's own)",
        (
            ("reward", ("critic/score/mean",)),
            ("entropy and grad norm", ("actor/entropy", "actor/grad_norm")),
        ),
    ),
)
"""Category -> charts (title, tags); the grouping docs/dashboards.md explains."""


@dataclass
class EventScalars:
    """The scalars of one event directory, and what could not be read."""

    series: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    truncated: list[str] = field(default_factory=list)
    """``"<file>: <n> bytes"`` per file whose tail is a partial record."""


def _records(data: bytes) -> tuple[list[bytes], int]:
    """The complete records of an event file's bytes, and how many trailing bytes were left (a partial one)."""
    out, pos = [], 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        end = pos + 12 + length + 4
        if end > len(data):
            break
        out.append(data[pos + 12 : pos + 12 + length])
        pos = end
    return out, len(data) - pos


def read_scalars(directory: Path) -> EventScalars:
    """Every scalar value (simple values and tensor summaries) of the event files in ``directory``."""
    try:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.util import tensor_util
    except ImportError as err:
        raise AlignmentError(
            f"{directory} holds TensorBoard events but the tensorboard package is missing: pip install tensorboard"
        ) from err
    result = EventScalars()
    for path in sorted(directory.glob("events.out.tfevents*")):
        records, left = _records(path.read_bytes())
        if left:
            result.truncated.append(f"{path.name}: {left} bytes")
        for raw in records:
            event = event_pb2.Event()
            try:
                event.ParseFromString(raw)
            except Exception:  # noqa: BLE001 - a corrupt record counts as unreadable, like a partial one
                result.truncated.append(f"{path.name}: a corrupt record")
                continue
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    number = float(value.simple_value)
                elif value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
                    number = float(tensor_util.make_ndarray(value.tensor).item())
                else:
                    continue
                result.series.setdefault(value.tag, {}).setdefault(int(event.step), []).append(number)
    return result


def write_layout(logdir: str | Path) -> Path:
    """Write the custom-scalars layout into ``logdir`` (TensorBoard reads it from any event file there)."""
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    categories = []
    for title, charts in LAYOUT_GROUPS:
        chart_pbs = [
            layout_pb2.Chart(
                title=chart, multiline=layout_pb2.MultilineChartContent(tag=[f"^{t}$" for t in tags])
            )
            for chart, tags in charts
        ]
        categories.append(layout_pb2.Category(title=title, chart=chart_pbs))
    layout = layout_pb2.Layout(category=categories).SerializeToString()
    # the summary custom_scalar.summary.pb builds, without TensorFlow: a string tensor under the config tag
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[layout])
    summary = summary_pb2.Summary(
        value=[
            summary_pb2.Summary.Value(
                tag=metadata.CONFIG_SUMMARY_TAG, metadata=metadata.create_summary_metadata(), tensor=tensor
            )
        ]
    )
    directory = Path(logdir)
    directory.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(directory), filename_suffix=".rlalign-layout")
    writer.add_event(event_pb2.Event(summary=summary))
    writer.close()
    return directory
