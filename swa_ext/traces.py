"""Request traces: arrival time, prompt length, output length.

Two formats are read:
- CSV with ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure LLM inference
  traces; the timestamp is a date-time, or a number of seconds);
- JSONL with ``timestamp`` (milliseconds), ``input_length``, ``output_length``
  (Mooncake traces).
Arrival times are returned in seconds from the first request.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_TRACE = Path(__file__).with_name("data") / "AzureLLMInferenceTrace_conv.csv"

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")

# datetime.fromisoformat before Python 3.11 takes at most 6 fractional digits;
# the Azure 2023 traces write 7.
_EXTRA_FRACTION_DIGITS = re.compile(r"(\.\d{6})\d+")


class TraceError(ValueError):
    """A trace that is missing or cannot be read; the message names the place."""


@dataclass(frozen=True)
class Request:
    rid: int  # position in the trace
    arrival_s: float
    prompt_len: int
    output_len: int


def _non_negative(value, what: str, where: str):
    if value < 0:
        raise TraceError(f"{where}: {what} is negative: {value}")
    return value


def _count(text: str, what: str, where: str) -> int:
    """A token count written as decimal digits (CSV)."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {what} is not an integer: {text!r}") from None
    return _non_negative(value, what, where)


def _json_count(value, what: str, where: str) -> int:
    """A token count as a JSON integer: not a bool, a float or a string."""
    if type(value) is not int:
        raise TraceError(f"{where}: {what} is not an integer: {value!r}")
    return _non_negative(value, what, where)


def _finite_time(value: float, what: str, where: str) -> float:
    if not math.isfinite(value):
        raise TraceError(f"{where}: {what} is not a finite number: {value!r}")
    return _non_negative(value, what, where)


def _azure_time(text: str, where: str) -> float:
    try:
        seconds = float(text)
    except (TypeError, ValueError):
        pass
    else:
        return _finite_time(seconds, "TIMESTAMP", where)
    try:
        stamp = datetime.fromisoformat(_EXTRA_FRACTION_DIGITS.sub(r"\1", text.strip()))
    except (AttributeError, ValueError):
        raise TraceError(f"{where}: TIMESTAMP is not a date-time: {text!r}") from None
    if stamp.tzinfo is None:
        # Read naive times as UTC so local daylight-saving shifts cannot bend gaps.
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def _read_azure(path: Path, limit: int | None) -> list[tuple[float, int, int]]:
    rows = []
    # utf-8-sig: a spreadsheet's CSV starts with a byte-order mark (its CRLF line
    # ends are the csv module's to read).
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(f"{path}: CSV trace lacks column(s) {', '.join(missing)}")
        for row in reader:
            if limit is not None and len(rows) >= limit:
                break
            # line_num, not a count of rows: the reader skips blank lines.
            where = f"{path}:{reader.line_num}"
            missing = [c for c in AZURE_COLUMNS if row[c] is None]
            if missing:
                fields = sum(v is not None for k, v in row.items() if k is not None)
                raise TraceError(f"{where}: the row has no {', '.join(missing)} field "
                                 f"({fields} fields where the header has {len(reader.fieldnames)})")
            rows.append(
                (
                    _azure_time(row["TIMESTAMP"], where),
                    _count(row["ContextTokens"], "ContextTokens", where),
                    _count(row["GeneratedTokens"], "GeneratedTokens", where),
                )
            )
    return rows


def _read_mooncake(path: Path, limit: int | None) -> list[tuple[float, int, int]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise TraceError(f"{where}: a record is a JSON object with {', '.join(MOONCAKE_KEYS)}")
            missing = [k for k in MOONCAKE_KEYS if k not in record]
            if missing:
                raise TraceError(f"{where}: the record has no {', '.join(missing)}")
            ts = record["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)):
                raise TraceError(f"{where}: timestamp is not a number: {ts!r}")
            rows.append(
                (
                    _finite_time(ts, "timestamp", where) / 1000.0,
                    _json_count(record["input_length"], "input_length", where),
                    _json_count(record["output_length"], "output_length", where),
                )
            )
    return rows


def load_trace(path: str | Path | None = None, limit: int | None = None) -> list[Request]:
    """The first ``limit`` requests of a trace (all when None), sorted by arrival.
    The format follows the suffix: ``.jsonl`` / ``.json`` is Mooncake, else CSV."""
    if path is not None and not str(path):
        raise TraceError("the trace path is empty")
    path = Path(path) if path is not None else DEFAULT_TRACE
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    if not path.is_file():
        raise TraceError(f"{path}: not a file")
    try:
        if path.suffix.lower() in (".jsonl", ".json"):
            rows = _read_mooncake(path, limit)
        else:
            rows = _read_azure(path, limit)
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text trace") from None
    except csv.Error as e:
        raise TraceError(f"{path}: malformed CSV ({e})") from None
    if not rows:
        raise TraceError(f"{path}: the trace holds no requests")
    start = min(t for t, _, _ in rows)
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    return [
        Request(rid=i, arrival_s=rows[i][0] - start, prompt_len=rows[i][1], output_len=rows[i][2])
        for i in order
    ]


# The shifted-mix trace (docs/simulator.md): chat, then long context, then code.
DATA = DEFAULT_TRACE.parent
SHIFTED_MIX_TRACE = DATA / "shifted_mix_trace.csv"
# (source, requests taken from its start, arrival-time stretch). The stretch makes each
# segment replay, at the default time scale 0.02, at the rate the notes replay its source:
# the Azure traces 50 times faster than recorded, the Mooncake sample 10 times (0.1 / 0.02).
SHIFTED_MIX_SEGMENTS = (
    (DEFAULT_TRACE, 3000, 1.0),
    (DATA / "mooncake_conversation_trace_2000.jsonl", 1000, 5.0),
    (DATA / "AzureLLMInferenceTrace_code.csv", 3000, 1.0),
)


def shifted_mix(segments) -> list[Request]:
    """One trace of segments played one after another: each ``(requests, stretch)``
    keeps its arrivals (relative to its first) times ``stretch``, and starts where the
    previous segment's last request arrived, one mean arrival gap of that segment later."""
    out: list[Request] = []
    start = 0.0
    for requests, stretch in segments:
        first = requests[0].arrival_s
        times = [start + (r.arrival_s - first) * stretch for r in requests]
        out += [Request(len(out) + i, t, r.prompt_len, r.output_len) for i, (r, t) in enumerate(zip(requests, times))]
        start = times[-1] + (times[-1] - times[0]) / max(len(times) - 1, 1)
    return out


def write_csv(requests: list[Request], path: str | Path) -> None:
    """Write requests as a CSV trace (``TIMESTAMP`` in seconds) that ``load_trace`` reads back."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(AZURE_COLUMNS)
        for r in requests:
            w.writerow((f"{r.arrival_s:.6f}", r.prompt_len, r.output_len))


def build_shifted_mix(path: str | Path = SHIFTED_MIX_TRACE) -> list[Request]:
    """Build the shifted-mix trace from the bundled traces (``SHIFTED_MIX_SEGMENTS``) and
    write it to ``path``: ``python -c "from swa_ext.traces import build_shifted_mix as b; b()"``."""
    requests = shifted_mix([(load_trace(source, count), stretch) for source, count, stretch in SHIFTED_MIX_SEGMENTS])
    write_csv(requests, path)
    return requests
