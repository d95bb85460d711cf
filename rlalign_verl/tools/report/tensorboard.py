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
from typing import Any

from rlalign_verl.base.errors import AlignmentError
from rlalign_verl.base.files import open_out_dir

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


LAYOUT_SUFFIX = ".rlalign-layout"
"""The suffix of the event file :func:`write_layout` writes (no scalars: not a run's file)."""


def is_run_event_file(path: Path) -> bool:
    """An event file a run wrote: a regular file named ``events.out.tfevents*``, not our layout file."""
    return (
        path.name.startswith("events.out.tfevents")
        and not path.name.endswith(LAYOUT_SUFFIX)
        and path.is_file()
    )


@dataclass
class EventScalars:
    """The scalars of one event directory, and what could not be read."""

    series: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    truncated: list[str] = field(default_factory=list)
    """``"<file>: <n> bytes"`` per file whose tail is a partial record (or a corrupt one)."""
    damaged: list[str] = field(default_factory=list)
    """``"<file>: <n> record(s)"`` per file with whole records that fail their data checksum (skipped)."""
    non_numeric: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Tag -> (count, example) of the values logged under a scalar tag that are not one number."""


def _records(data: bytes) -> tuple[list[bytes], int, int]:
    """The complete records of an event file's bytes whose data passes its checksum; how many trailing bytes were
    left (a partial record, or from the first record whose length field fails its checksum: garbage, not a
    record); and how many whole records failed their data checksum (damaged bytes: skipped, never read as a
    value — protobuf would parse a flipped bit as another number)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    out, pos, damaged = [], 0, 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        (length_crc,) = struct.unpack_from("<I", data, pos + 8)
        end = pos + 12 + length + 4
        if length_crc != masked_crc32c(data[pos : pos + 8]) or end > len(data):
            break
        record = data[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", data, end - 4)
        if data_crc == masked_crc32c(record):
            out.append(record)
        else:
            damaged += 1
        pos = end
    return out, len(data) - pos, damaged


def _scalar(value: Any, tensor_util: Any) -> float | str:
    """The one number of a summary value, or why it is not one (a string, a non-scalar tensor)."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    try:
        array = tensor_util.make_ndarray(value.tensor)
    except Exception as err:  # noqa: BLE001 - an undecodable tensor is a non-numeric value, said
        return f"undecodable tensor ({type(err).__name__})"
    if array.size != 1 or array.dtype.kind not in "biuf":
        return f"a {array.dtype} tensor of shape {tuple(array.shape)}"
    return float(array.reshape(()).item())


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
    for path in sorted(p for p in directory.glob("events.out.tfevents*") if is_run_event_file(p)):
        try:
            data = path.read_bytes()
        except OSError as err:
            raise AlignmentError(
                f"event file {path} cannot be read ({err.strerror or type(err).__name__}); "
                "make it readable or pass another run"
            ) from None
        records, left, damaged = _records(data)
        if left:
            result.truncated.append(f"{path.name}: {left} bytes")
        if damaged:
            result.damaged.append(f"{path.name}: {damaged} record(s)")
        for raw in records:
            event = event_pb2.Event()
            try:
                event.ParseFromString(raw)
            except Exception:  # noqa: BLE001 - a corrupt record counts as unreadable, like a partial one
                result.truncated.append(f"{path.name}: a corrupt record")
                continue
            for value in event.summary.value:
                if not value.HasField("simple_value") and not (
                    value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars"
                ):
                    continue
                number = _scalar(value, tensor_util)
                if isinstance(number, str):
                    count, example = result.non_numeric.get(value.tag, (0, f"{number} at step {event.step}"))
                    result.non_numeric[value.tag] = (count + 1, example)
                    continue
                result.series.setdefault(value.tag, {}).setdefault(int(event.step), []).append(number)
    return result


def layout_event_bytes() -> bytes:
    """An event file (TFRecord framing) holding the custom-scalars layout of :data:`LAYOUT_GROUPS`."""
    import io
    import time

    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.summary.writer.record_writer import RecordWriter

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
    buf = io.BytesIO()
    writer = RecordWriter(buf)
    now = time.time()
    writer.write(event_pb2.Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
    writer.write(event_pb2.Event(wall_time=now, summary=summary).SerializeToString())
    return buf.getvalue()


def write_layout(logdir: str | Path) -> Path:
    """Write the custom-scalars layout into ``logdir`` (TensorBoard reads it from any event file there).

    The directory is checked like ``--out`` (no link, a directory, writable) before the file is written;
    the file is written inside it only, never through a link.
    """
    import os
    import socket
    import time

    data = layout_event_bytes()
    name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}{LAYOUT_SUFFIX}"
    with open_out_dir(logdir, flag="--tensorboard-layout") as out_dir:
        out_dir.check([name])
        out_dir.write(name, data)
    return Path(logdir)
