"""The simulated clock's pieces against hand-computed examples: participant counts (HtFLlib's
-rjr), drop-outs (-cdr), slow clients (-tsr/-ssr), a participant's seconds, who a deadline keeps,
and traces refused in one line naming file, line or entry, and field."""
from __future__ import annotations

import csv
import json
import re

import pytest

from htfl_dist.config import ParticipationConfig
from htfl_dist.errors import ConfigError
from htfl_dist.runtime.clock import (
    ClientDevice,
    client_seconds,
    dropped_clients,
    htfllib_slow_clients,
    is_available,
    join_count,
    profile_devices,
    read_trace,
    round_times,
    tier_devices,
)


def test_join_count_is_int_n_rho_or_drawn_between_it_and_n():
    assert join_count(0, 0, 10, 0.3, random_join=False) == 3
    assert join_count(0, 0, 10, 0.01, random_join=False) == 1  # at least one
    counts = [join_count(7, r, 10, 0.3, random_join=True) for r in range(400)]
    assert set(counts) == set(range(3, 11))  # HtFLlib: uniform over int(N·ρ)..N, both ends included
    assert counts == [join_count(7, r, 10, 0.3, random_join=True) for r in range(400)]  # (seed, round) only
    assert join_count(7, 5, 10, 1.0, random_join=True) == 10


def test_drop_out_keeps_int_one_minus_rate_times_n_uploads():
    participants = list(range(10, 20))
    assert dropped_clients(0, 3, participants, 0.0) == []
    dropped = dropped_clients(0, 3, participants, 0.2)
    assert len(dropped) == 2 and set(dropped) <= set(participants)
    assert len(dropped_clients(0, 3, participants, 0.25)) == 3  # int(0.75 · 10) = 7 arrive
    assert dropped == dropped_clients(0, 3, participants, 0.2)
    other_rounds = {tuple(dropped_clients(0, r, participants, 0.2)) for r in range(20)}
    assert len(other_rounds) > 5  # a fresh draw each round


def test_htfllib_slow_clients_are_drawn_with_replacement():
    slow = htfllib_slow_clients(0, 10, 0.5, "train")
    assert 1 <= len(slow) <= 5 and slow <= set(range(10))
    assert htfllib_slow_clients(0, 10, 0.0, "train") == set()
    # with replacement, as HtFLlib draws them: some seeds give fewer than int(rate·N) distinct clients
    assert min(len(htfllib_slow_clients(seed, 10, 0.5, "train")) for seed in range(20)) < 5
    devices = profile_devices(0, 10, bandwidth_mbps=80, train_slow_rate=0.5, send_slow_rate=0.0)
    assert {c for c, d in enumerate(devices) if d.slow_training} == slow
    assert all(d.bandwidth == 10e6 and d.speed == 1.0 and not d.slow_sending for d in devices)


def test_tiers_split_the_clients_by_their_shares():
    """10 clients at 0.5 / 0.3 / 0.2: 5, 3 and 2 of them; 7 clients at 0.5 / 0.5: 4 and 3 (the
    remainder to the earlier tier); the members from the seed; the slow fractions on top."""
    tiers = [(0.5, 1.0, 100.0), (0.3, 0.5, 20.0), (0.2, 0.1, 8.0)]
    devices = tier_devices(0, 10, tiers, train_slow_rate=0.0, send_slow_rate=0.0)
    assert sorted(d.speed for d in devices) == [0.1] * 2 + [0.5] * 3 + [1.0] * 5
    assert all(d.bandwidth == {1.0: 12.5e6, 0.5: 2.5e6, 0.1: 1e6}[d.speed] for d in devices)
    assert devices == tier_devices(0, 10, tiers, 0.0, 0.0) != tier_devices(1, 10, tiers, 0.0, 0.0)
    halves = tier_devices(0, 7, [(0.5, 1.0, 8.0), (0.5, 2.0, 8.0)], 0.0, 0.0)
    assert sorted(d.speed for d in halves) == [1.0] * 4 + [2.0] * 3
    slow = tier_devices(0, 10, tiers, train_slow_rate=0.5, send_slow_rate=0.0)
    assert {c for c, d in enumerate(slow) if d.slow_training} == htfllib_slow_clients(0, 10, 0.5, "train")


@pytest.mark.parametrize("tiers, needle", [
    ("0.5:1:100,0.4:0.5:20", "the shares sum to 0.9, not 1"),
    ("0.5:1:100,0.5:0:20", "tier 2 (0.5:0:20) needs a share in (0, 1] and a finite speed and bandwidth > 0"),
    ("1:1", "tier 1 is '1:1'; a tier is SHARE:SPEED:MBPS"),
])
def test_bad_tiers_are_one_line(tiers, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        ParticipationConfig(clock=True, profile="tiers", tiers=tiers).check()
    with pytest.raises(ConfigError, match="set both or neither"):
        ParticipationConfig(clock=True, profile="tiers").check()


def test_client_seconds_by_hand():
    device = ClientDevice(speed=2.0, bandwidth=12.5e6)
    common = dict(steps=10, flops_per_step=1e9, reference_flops=1e12, seed=0, client_id=3, round_index=1)
    # 10 · 1e9 / (1e12 · 2) = 5 ms of compute, 1.25 MB at 12.5 MB/s = 100 ms of transfers
    assert client_seconds(device, bytes_moved=1_250_000, jitter=0.0, **common) == pytest.approx(0.105)
    jittered = client_seconds(device, bytes_moved=0, jitter=0.5, **common)
    assert jittered != pytest.approx(0.005) and 0.005 * 0.1 < jittered < 0.005 * 10
    assert jittered == client_seconds(device, bytes_moved=0, jitter=0.5, **common)
    slow = client_seconds(ClientDevice(2.0, 12.5e6, slow_training=True), bytes_moved=0, jitter=0.0, **common)
    assert 0.005 < slow < 0.005 + 10 * 0.1  # U(0, 0.1) s for each of the 10 batches
    sending = client_seconds(ClientDevice(2.0, 12.5e6, slow_sending=True), bytes_moved=0, jitter=0.0, **common)
    assert 0.005 < sending < 0.005 + 2 * 0.1


def test_a_deadline_keeps_the_uploads_that_arrive_by_it():
    seconds = {0: 1.0, 1: 5.0, 2: 3.0, 3: 9.0}
    times = round_times(seconds, dropped=[1], deadline_s=4.0)
    assert (times.arrived, times.late, times.dropped, times.round_seconds) == ([0, 2], [3], [1], 4.0)
    times = round_times(seconds, dropped=[1], deadline_s=0.0)  # no deadline: the last arrival ends it
    assert (times.arrived, times.late, times.round_seconds) == ([0, 2, 3], [], 9.0)
    times = round_times(seconds, dropped=[3], deadline_s=0.0)  # a lost upload is not waited for
    assert times.round_seconds == 5.0
    times = round_times({0: 4.0, 1: 4.000001}, dropped=[], deadline_s=4.0)  # at the deadline is in time
    assert (times.arrived, times.late) == ([0], [1])
    times = round_times({0: 7.0}, dropped=[], deadline_s=4.0)
    assert (times.arrived, times.late, times.round_seconds) == ([], [0], 4.0)


def _csv(tmp_path, text: str):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_a_trace_gives_each_client_its_speed_and_bandwidth(tmp_path):
    devices = read_trace(_csv(tmp_path, "client,speed,bandwidth_mbps\n1,0.5,8\n0,2,16\n"), 2)
    assert devices == [ClientDevice(2.0, 2e6), ClientDevice(0.5, 1e6)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps([{"client": 0, "speed": 1, "bandwidth_mbps": 8}]))
    assert read_trace(path, 1) == [ClientDevice(1.0, 1e6)]


def test_availability_windows_from_a_trace(tmp_path):
    """CSV cells START-END;START-END, JSON pairs; windows are [start, end), repeating with a period."""
    devices = read_trace(_csv(tmp_path, "client,speed,bandwidth_mbps,available\n0,1,8,3600-7200;0-60\n1,1,8,\n"), 2)
    assert devices[0].windows == ((0.0, 60.0), (3600.0, 7200.0)) and devices[1].windows == ()
    path = tmp_path / "trace.json"
    path.write_text(json.dumps([{"client": 0, "speed": 1, "bandwidth_mbps": 8, "available": [[10, 20]]}]))
    (device,) = read_trace(path, 1)
    assert [is_available(device, t, 0) for t in (9.9, 10, 19.9, 20, 110)] == [False, True, True, False, False]
    assert [is_available(device, t, 100) for t in (110, 125, 1015)] == [True, False, True]
    assert is_available(devices[1], 1e9, 0)  # no windows: always


@pytest.mark.parametrize("available, needle", [
    ("5-2", "available window 5-2 must have 0 <= start < end"),
    ("a-b", "available has ['a', 'b']; a window is START-END"),
    ("7", "available has ['7']; a window is START-END"),
    ("1-inf", "available window 1-inf must have 0 <= start < end, both finite"),
])
def test_a_bad_availability_window_is_one_line(tmp_path, available, needle):
    path = _csv(tmp_path, f"client,speed,bandwidth_mbps,available\n0,1,8,{available}\n")
    with pytest.raises(ConfigError) as refused:
        read_trace(path, 1)
    assert str(refused.value).startswith(f"participation.trace {path}: line 2: ")
    assert needle in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("text, needles", [
    ("client,speed,bandwidth_mbps\n0,-1,8\n1,1,8\n", ["line 2", "speed is -1", "finite number > 0"]),
    ("client,speed,bandwidth_mbps\n0,1,nan\n1,1,8\n", ["line 2", "bandwidth_mbps is nan"]),
    ("client,speed,bandwidth_mbps\n0,1,8\n0,1,8\n", ["line 3", "client 0 appears twice"]),
    ("client,speed,bandwidth_mbps\n0,1,8\n", ["no entry for client(s) [1]"]),
    ("client,speed,bandwidth_mbps\n0,1,8\n5,1,8\n", ["line 3", "client 5 is outside 0..1"]),
    ("client,speed\n0,1\n1,1\n", ["line 1 lacks the column(s) bandwidth_mbps"]),
    ("client,speed,bandwidth_mbps\nzero,1,8\n1,1,8\n", ["line 2", "client is 'zero', not a number"]),
])
def test_a_bad_trace_is_one_line_naming_file_line_and_field(tmp_path, text, needles):
    path = _csv(tmp_path, text)
    with pytest.raises(ConfigError) as refused:
        read_trace(path, 2)
    message = str(refused.value)
    assert message.startswith(f"participation.trace {path}: ") and "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_a_missing_or_foreign_trace_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        read_trace(tmp_path / "absent.csv", 2)
    path = tmp_path / "trace.json"
    path.write_text('{"client": 0}')
    with pytest.raises(ConfigError, match="a JSON trace is a list of objects"):
        read_trace(path, 1)


def _bytes(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


HEADER = b"client,speed,bandwidth_mbps,available\n"


@pytest.mark.parametrize("name, data, needle", [
    ("trace.csv", HEADER + b"0,1,8,0-60\n1,1,8,caf\xe9\n", "line 3, field 'available': byte 0xe9 is not UTF-8 "
                                                            "(offset 58); save the trace as UTF-8"),
    ("trace.csv", HEADER + b"0,1\xff,8,\n1,1,8,\n", "line 2, field 'speed': byte 0xff is not UTF-8"),
    ("trace.csv", HEADER + b"0,1,8,\n1,1,8," + b"9" * 1_200_000 + b"\n",
     "line 3: field 'available' holds 1200000 characters, more than the 640000 a trace cell may hold"),
    ("trace.csv", HEADER + b'0,1,8,\n1,"1\n' + b"9" * 700_000 + b'",8,\n',
     "line 3: field 'speed' holds 700002 characters"),  # a quoted cell across lines: the line it starts on
    ("trace.csv", HEADER + b"0,1,8,,\n1,1,8,," + b"x" * 700_000 + b"\n",
     "line 3: field a cell past the header's columns holds 700000 characters"),
    ("trace.json", b'[{"client": 0, "speed": 1,\n  "bandwidth_mbps": 8, "available": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}]", "line 2, field 'available': nested more than Python's JSON reader can follow"),
    ("trace.json", b'[{"client": 0,\n "speed": "caf\xe9", "bandwidth_mbps": 8}]',
     "line 2, field 'speed': byte 0xe9 is not UTF-8 (offset 29)"),
], ids=["csv-latin1", "csv-latin1-header-column", "csv-megabyte-cell", "csv-quoted-cell-over-lines",
        "csv-cell-past-the-header", "json-nesting-bomb", "json-latin1"])
def test_a_trace_the_readers_choke_on_is_one_line_naming_file_line_and_field(tmp_path, name, data, needle):
    """Were a UnicodeDecodeError, a csv field-limit error and a RecursionError traceback (the audit):
    offsets and lines counted by hand from the bytes above."""
    path = _bytes(tmp_path, name, data)
    limit = csv.field_size_limit()
    with pytest.raises(ConfigError) as refused:
        read_trace(path, 2)
    message = str(refused.value)
    assert message.startswith(f"participation.trace {path}: ") and "\n" not in message and len(message) < 400
    assert needle in message, message
    assert csv.field_size_limit() == limit  # put back as it was


def test_a_long_but_valid_availability_cell_is_read(tmp_path):
    """9,000 windows of 18 characters: 162,000 characters, past csv's default limit of 131,072 (which
    refused it), within the trace's own; and a UTF-8 byte-order mark (a spreadsheet's export)."""
    windows = ";".join(f"{100_000 + 2 * k}.5-{100_001 + 2 * k}.5" for k in range(9000))
    path = _bytes(tmp_path, "trace.csv", b"\xef\xbb\xbf" + HEADER + f"0,1,8,{windows}\n".encode())
    assert len(windows) > 131_072
    (device,) = read_trace(path, 1)
    assert len(device.windows) == 9000 and device.windows[0] == (100_000.5, 100_001.5)


def test_clock_options_need_the_clock():
    ParticipationConfig(drop_rate=0.5, random_join=True).check()  # no clock needed
    for options in ({"deadline_s": 2.0}, {"train_slow_rate": 0.3}, {"profile": "trace", "trace": "t.csv"}):
        with pytest.raises(ConfigError, match=r"acts on the simulated clock; set participation\.clock=true"):
            ParticipationConfig(**options).check()
    with pytest.raises(ConfigError, match="set both or neither"):
        ParticipationConfig(clock=True, profile="trace").check()


def test_a_late_upload_is_folded_once_and_a_fresh_one_wins(cache_dir):
    """participation.late=next_round on rank 0's arrivals: a late upload joins the next round's
    uploads (its client listed), is not kept longer, and gives way to its client's fresh upload."""
    import torch

    from conftest import SMOKE
    from htfl_dist.config import load_config
    from htfl_dist.data import prepare_partition
    from htfl_dist.runtime.participation import Participation

    config = load_config(SMOKE, [f"data.cache_dir={cache_dir}", "participation.clock=true",
                                 "participation.deadline_s=10", "participation.late=next_round"])
    late_in = {0: {1, 2}, 1: {2, 3}, 2: set()}  # round -> clients past the deadline
    sampled = {0: list(range(6)), 1: list(range(6)), 2: [0, 1, 2, 4, 5]}

    class Scripted(Participation):
        def seconds(self, client_id, round_index, bytes_moved):
            return 20.0 if client_id in late_in[round_index] else 1.0

    info = prepare_partition(config.data, 6, 0)
    participation = Scripted(config, info, [ClientDevice()] * 6)
    upload = lambda r, c: {"protos": torch.tensor([[float(10 * r + c)]])}  # noqa: E731
    decided = [participation.decide(r, sampled[r], {c: upload(r, c) for c in sampled[r]}, 0) for r in range(3)]
    assert [d.folded for d in decided] == [[], [2], [3]]  # round 1: client 1's fresh upload wins
    assert [sorted(d.kept) for d in decided] == [[0, 3, 4, 5], [0, 1, 2, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert float(decided[1].kept[1]["protos"]) == 11.0 and float(decided[1].kept[2]["protos"]) == 2.0
    assert float(decided[2].kept[2]["protos"]) == 22.0 and float(decided[2].kept[3]["protos"]) == 13.0
    assert participation.held == {}  # folded once, not kept longer
    held = Scripted(config, info, [ClientDevice()] * 6)
    held.decide(0, sampled[0], {c: upload(0, c) for c in sampled[0]}, 0)
    restored = Scripted(config, info, [ClientDevice()] * 6)
    restored.load_state_dict(held.state_dict())
    assert sorted(restored.held) == [1, 2] and float(restored.held[2]["protos"]) == 2.0
    assert restored.clock_s == held.clock_s == 10.0
