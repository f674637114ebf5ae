"""A simulated clock for federations whose clients are slow, drop out or miss a deadline.

Real federations do not wait for every client: a round ends at a deadline with whoever arrived,
some uploads are lost, some devices are ten times slower than others. HtFLlib imitates slow
clients by making them *sleep*, which wastes the accelerator it is short of. Here nobody sleeps:
rank 0 computes, for every participant of a round, the time it *would* have taken, from numbers
that are the same on every rank and in every run of the config, and decides from those times
whose upload is aggregated. The maths of a round therefore stays a function of (config, seed,
round), whatever the world size, and a resumed run continues the same clock.

A participant's simulated seconds in a round::

    steps · 3 · FLOPs(member) · batch / (reference FLOP/s · speed) · jitter
    + slow-training delay (HtFLlib's -tsr: U(0, 0.1) s per batch for its slow clients)
    + (bytes up + bytes down) / bandwidth
    + slow-sending delay (HtFLlib's -ssr: U(0, 0.1) s per transfer for its slow clients)

FLOPs are the architecture's forward FLOPs per sample counted on the meta device (a training
step is about three forward passes), so the clock is identical on every machine; ``jitter`` is
lognormal(0, σ) per (seed, client, round). Speeds and bandwidths come from a profile drawn from
(seed, client) or from a trace file (:func:`read_trace`).

Everything here is a pure function of its arguments: the round loop supplies the counts and the
bytes, and keeps the clock's one piece of state (the simulated time so far) in rank 0's
checkpoint.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from htfl_dist.config.participation_section import round_participants
from htfl_dist.errors import ConfigError, shown
from htfl_dist.seeding import numpy_rng

HTFLLIB_SLOW_DELAY_S = 0.1
"""HtFLlib's slow clients sleep 0.1·|U(0, 1)| s per training batch (-tsr) or per transfer (-ssr)."""
MAX_TRACE_BYTES = 64 * 2**20
"""A trace file larger than this is refused before it is read."""
TRACE_FIELDS = ("client", "speed", "bandwidth_mbps")
MAX_WINDOWS = 10_000
"""Availability windows one client may have (a bound before anything is allocated for them)."""


@dataclass(frozen=True)
class ClientDevice:
    """One client's simulated device: compute speed relative to the reference device, link
    bandwidth in bytes per second (up and down), and HtFLlib's two slow flags."""

    speed: float = 1.0
    bandwidth: float = 12.5e6
    slow_training: bool = False
    slow_sending: bool = False
    windows: tuple[tuple[float, float], ...] = ()
    """When the device can take part, as [start, end) intervals of simulated seconds (a trace's
    ``available``); empty: always."""


def is_available(device: ClientDevice, at_s: float, period_s: float) -> bool:
    """Whether ``device`` can take part in a round that starts at simulated second ``at_s``:
    inside one of its windows, which repeat every ``period_s`` seconds (0: they do not repeat,
    as FedScale's traces of one day are read as a day that repeats only if asked)."""
    if not device.windows:
        return True
    t = at_s % period_s if period_s > 0 else at_s
    return any(start <= t < end for start, end in device.windows)


@dataclass(frozen=True)
class RoundTimes:
    """Rank 0's decision for one round: whose uploads are aggregated, and when the round ended."""

    seconds: dict[int, float]
    """Every participant's simulated seconds (training, transfers, delays)."""
    dropped: list[int]
    """Trained, but the upload was lost (participation.drop_rate)."""
    late: list[int]
    """Arrived after the deadline: not aggregated this round."""
    arrived: list[int]
    """Aggregated (in client-id order)."""
    round_seconds: float
    """When the server stopped waiting: the deadline if anyone was late, else the last arrival."""


# ---------------------------------------------------------------------------- devices


def htfllib_slow_clients(seed: int, num_clients: int, rate: float, kind: str) -> set[int]:
    """int(rate·N) draws *with* replacement, as HtFLlib's ``select_slow_clients`` makes them (so a
    little fewer distinct clients than rate·N), from the (seed, kind) stream."""
    draws = numpy_rng(seed, "slow-clients", kind).choice(num_clients, size=int(rate * num_clients), replace=True)
    return {int(client) for client in draws}


def profile_devices(seed: int, num_clients: int, bandwidth_mbps: float, train_slow_rate: float,
                    send_slow_rate: float) -> list[ClientDevice]:
    """Every client at the reference speed and ``bandwidth_mbps``; HtFLlib's slow fractions."""
    slow_training = htfllib_slow_clients(seed, num_clients, train_slow_rate, "train")
    slow_sending = htfllib_slow_clients(seed, num_clients, send_slow_rate, "send")
    return [ClientDevice(1.0, bandwidth_mbps * 1e6 / 8, client in slow_training, client in slow_sending)
            for client in range(num_clients)]


def tier_devices(seed: int, num_clients: int, tiers: Sequence[tuple[float, float, float]],
                 train_slow_rate: float, send_slow_rate: float) -> list[ClientDevice]:
    """Clients in tiers of (share, speed, Mbit/s): the counts by largest remainder of share·N (so
    they sum to N; ties to the earlier tier), the members by a permutation from (seed); HtFLlib's
    slow fractions on top, as for the uniform profile."""
    quotas = [share * num_clients for share, _, _ in tiers]
    counts = [int(q) for q in quotas]
    for index in sorted(range(len(tiers)), key=lambda i: (-(quotas[i] - counts[i]), i))[: num_clients - sum(counts)]:
        counts[index] += 1
    order = numpy_rng(seed, "device-tiers").permutation(num_clients)
    tier_of = np.empty(num_clients, dtype=np.int64)
    start = 0
    for index, count in enumerate(counts):
        tier_of[order[start : start + count]] = index
        start += count
    base = profile_devices(seed, num_clients, 1.0, train_slow_rate, send_slow_rate)
    return [dataclasses.replace(device, speed=tiers[tier_of[c]][1], bandwidth=tiers[tier_of[c]][2] * 1e6 / 8)
            for c, device in enumerate(base)]


def read_trace(path: str | Path, num_clients: int) -> list[ClientDevice]:
    """Per-client speed factor and bandwidth from a CSV (header ``client,speed,bandwidth_mbps``)
    or a JSON list of such objects, each with an optional ``available``: the client's windows of
    simulated seconds, ``0-3600;7200-9000`` in a CSV cell or ``[[0, 3600], [7200, 9000]]`` in JSON
    (absent or empty: always available). Every client 0..N-1 exactly once; speeds and bandwidths
    finite and positive, windows finite with start < end; anything else one line naming file,
    line (CSV) or entry (JSON) and field."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ConfigError(f"participation.trace {path}: cannot read it ({exc.strerror})") from None
    if size > MAX_TRACE_BYTES:
        raise ConfigError(f"participation.trace {path}: {size} bytes, more than the {MAX_TRACE_BYTES} a trace may hold")
    rows = _json_rows(path) if path.suffix.lower() == ".json" else _csv_rows(path)
    return _devices_from_rows(path, rows, num_clients)


def _trace_text(path: Path) -> tuple[bytes, str]:
    """The trace's bytes and its text: UTF-8 (a byte-order mark allowed). Other bytes are one line
    naming the line and the field (CSV: by the header's names) they are in."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"participation.trace {path}: cannot read it ({exc.strerror})") from None
    try:
        return raw, raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line, field = _place(raw, exc.start, path.suffix.lower() == ".json")
        raise ConfigError(f"participation.trace {path}: line {line}{field}: byte 0x{raw[exc.start]:02x} is not UTF-8 "
                          f"(offset {exc.start}); save the trace as UTF-8") from None


_JSON_KEY = re.compile(rb'"((?:[^"\\]|\\.){1,64})"\s*:')


def _place(raw: bytes, offset: int, is_json: bool) -> tuple[int, str]:
    """The 1-based line of byte ``offset`` and, for the error line, the field it is in (', field
    NAME'), as far as the bytes before it tell: a CSV column by the header's name, a JSON object's
    latest key ('' when none is known)."""
    line = raw.count(b"\n", 0, offset) + 1
    start = raw.rfind(b"\n", 0, offset) + 1
    if is_json:
        keys = _JSON_KEY.findall(raw, max(0, offset - 4096), offset)
        return line, f", field {keys[-1].decode('utf-8', 'replace')!r}" if keys else ""
    column = next(csv.reader([raw[start:offset].decode("utf-8", "replace")]), [""])
    header = next(csv.reader([raw[: raw.find(b"\n")].decode("utf-8", "replace")]), []) if line > 1 else []
    index = len(column) - 1
    return line, f", field {header[index]!r}" if index < len(header) else f", column {index + 1}"


MAX_CELL_CHARS = 64 * MAX_WINDOWS
"""The longest CSV cell a trace may hold: ``available`` with ``MAX_WINDOWS`` windows of two long
numbers each fits; a cell beyond it is refused by name (csv's own limit, 128 KiB, would end in
its error without line or column, and cut a long but valid ``available``)."""


def _csv_rows(path: Path) -> list[tuple[str, Mapping[str, object]]]:
    _, text = _trace_text(path)
    reader = csv.DictReader(io.StringIO(text, newline=""))
    limit = csv.field_size_limit(MAX_TRACE_BYTES)  # the file's size bounds every cell; checked by name below
    try:
        missing = [name for name in TRACE_FIELDS if name not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"participation.trace {path}: line 1 lacks the column(s) {', '.join(missing)} "
                              f"(the header must name {', '.join(TRACE_FIELDS)})")
        rows: list[tuple[str, Mapping[str, object]]] = []
        first_line = reader.line_num + 1
        for row in reader:
            where = f"line {first_line}"
            for name, value in row.items():
                cells = value if isinstance(value, list) else [value]  # cells past the header: a list
                if any(isinstance(cell, str) and len(cell) > MAX_CELL_CHARS for cell in cells):
                    field = repr(name) if name is not None else "a cell past the header's columns"
                    raise ConfigError(f"participation.trace {path}: {where}: field {field} holds "
                                      f"{max(len(cell) for cell in cells if isinstance(cell, str))} characters, more "
                                      f"than the {MAX_CELL_CHARS} a trace cell may hold")
            rows.append((where, row))
            first_line = reader.line_num + 1
        return rows
    except csv.Error as exc:
        raise ConfigError(f"participation.trace {path}: line {reader.line_num}: not CSV ({exc})") from None
    finally:
        csv.field_size_limit(limit)


MAX_JSON_DEPTH = 32
"""Where a nesting bomb is reported: a trace nests four deep (the list, an entry, ``available``,
a window)."""


def _json_rows(path: Path) -> list[tuple[str, Mapping[str, object]]]:
    raw, text = _trace_text(path)
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"participation.trace {path}: not JSON ({exc})") from None
    except RecursionError:
        line, field = _place(raw, _too_deep(raw), is_json=True)
        raise ConfigError(f"participation.trace {path}: line {line}{field}: nested more than Python's JSON reader "
                          f"can follow (a trace nests 4 deep: the list, an entry, available, a window)") from None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ConfigError(f"participation.trace {path}: a JSON trace is a list of objects with "
                          f"{', '.join(TRACE_FIELDS)}")
    return [(f"entry {index}", entry) for index, entry in enumerate(entries)]


_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _too_deep(raw: bytes) -> int:
    """The offset of the first bracket nested deeper than :data:`MAX_JSON_DEPTH` (strings skipped)."""
    depth = 0
    for token in _JSON_TOKEN.finditer(raw):
        bracket = token.group()
        if bracket in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return token.start()
        elif bracket in (b"]", b"}"):
            depth -= 1
    return 0


def _number(path: Path, where: str, row: Mapping[str, object], name: str, *, integer: bool = False) -> float:
    value = row.get(name)
    try:
        number = int(str(value)) if integer else float(str(value))
    except ValueError:
        raise ConfigError(f"participation.trace {path}: {where}: {name} is {shown(value)}, not a number") from None
    if not integer and not (math.isfinite(number) and number > 0):
        raise ConfigError(f"participation.trace {path}: {where}: {name} is {value}; it must be a finite number > 0")
    return number


def _windows(path: Path, where: str, value: object) -> tuple[tuple[float, float], ...]:
    """A trace entry's ``available`` as sorted [start, end) pairs; None or '' means always."""
    if value is None or value == "" or value == []:
        return ()
    if isinstance(value, str):
        pieces: list[object] = [piece.split("-", 1) for piece in value.split(";") if piece.strip()]
    elif isinstance(value, list):
        pieces = value
    else:
        pieces = [value]
    if len(pieces) > MAX_WINDOWS:
        raise ConfigError(f"participation.trace {path}: {where}: available has {len(pieces)} windows, more than "
                          f"{MAX_WINDOWS}")
    windows = []
    for piece in pieces:
        try:
            if not isinstance(piece, list | tuple):
                raise TypeError
            start, end = (float(str(bound).strip()) for bound in piece)
        except (TypeError, ValueError):
            raise ConfigError(f"participation.trace {path}: {where}: available has {shown(piece)}; a window is "
                              f"START-END in a CSV cell or [START, END] in JSON, in simulated seconds") from None
        if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
            raise ConfigError(f"participation.trace {path}: {where}: available window {start:g}-{end:g} must have "
                              f"0 <= start < end, both finite")
        windows.append((start, end))
    return tuple(sorted(windows))


def _devices_from_rows(path: Path, rows: Sequence[tuple[str, Mapping[str, object]]],
                       num_clients: int) -> list[ClientDevice]:
    devices: dict[int, ClientDevice] = {}
    for where, row in rows:
        client = int(_number(path, where, row, "client", integer=True))
        if not 0 <= client < num_clients:
            raise ConfigError(f"participation.trace {path}: {where}: client {client} is outside 0..{num_clients - 1}")
        if client in devices:
            raise ConfigError(f"participation.trace {path}: {where}: client {client} appears twice")
        devices[client] = ClientDevice(_number(path, where, row, "speed"),
                                       _number(path, where, row, "bandwidth_mbps") * 1e6 / 8,
                                       windows=_windows(path, where, row.get("available")))
    missing = [client for client in range(num_clients) if client not in devices]
    if missing:
        raise ConfigError(f"participation.trace {path}: no entry for client(s) {missing[:5]}"
                          f"{' ...' if len(missing) > 5 else ''}; a trace names every client once")
    return [devices[client] for client in range(num_clients)]


# ---------------------------------------------------------------------------- one round


def join_count(seed: int, round_index: int, num_clients: int, join_ratio: float, random_join: bool) -> int:
    """How many clients take part: int(N·ρ) (at least one); with ``random_join`` (HtFLlib's -rjr)
    a count drawn uniformly from int(N·ρ)..N each round from the (seed, round) stream."""
    fixed = round_participants(num_clients, join_ratio)
    if not random_join or fixed >= num_clients:
        return fixed
    return int(numpy_rng(seed, "join-count", round_index).integers(fixed, num_clients + 1))


def dropped_clients(seed: int, round_index: int, participants: Sequence[int], drop_rate: float) -> list[int]:
    """HtFLlib's -cdr: of the n participants, int((1 − rate)·n) uploads arrive, the others are
    lost after the client trained; which ones from the (seed, round) stream."""
    keep = int((1 - drop_rate) * len(participants))
    if keep >= len(participants):
        return []
    order = numpy_rng(seed, "drop-out", round_index).permutation(len(participants))
    return sorted(int(participants[i]) for i in order[keep:])


def client_seconds(device: ClientDevice, *, steps: int, flops_per_step: float, reference_flops: float,
                   bytes_moved: int, seed: int, client_id: int, round_index: int, jitter: float) -> float:
    """One participant's simulated seconds in a round (the module docstring's formula);
    ``flops_per_step``: 3 · forward FLOPs per sample · batch size."""
    rng = numpy_rng(seed, "clock", client_id, round_index)
    factor = float(np.exp(jitter * rng.standard_normal())) if jitter else 1.0
    seconds = steps * flops_per_step / (reference_flops * device.speed) * factor
    if device.slow_training:
        seconds += HTFLLIB_SLOW_DELAY_S * float(np.abs(rng.random(steps)).sum())
    seconds += bytes_moved / device.bandwidth
    if device.slow_sending:
        seconds += HTFLLIB_SLOW_DELAY_S * float(np.abs(rng.random(2)).sum())  # the download and the upload
    return seconds


def round_times(seconds: Mapping[int, float], dropped: Sequence[int], deadline_s: float) -> RoundTimes:
    """Who is aggregated: every participant not dropped whose upload arrives by the deadline (0:
    none). The round ends at the deadline when anyone is late, else at the last arrival (a
    dropped upload is never waited for)."""
    lost = set(dropped)
    late = sorted(c for c, s in seconds.items() if c not in lost and deadline_s and s > deadline_s)
    arrived = sorted(c for c in seconds if c not in lost and c not in late)
    if late:
        ended = deadline_s
    else:
        ended = max((seconds[c] for c in arrived), default=deadline_s or max(seconds.values(), default=0.0))
    return RoundTimes(dict(seconds), sorted(lost), late, arrived, ended)
