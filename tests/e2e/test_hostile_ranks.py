"""Client ranks that lie: rank 0 refuses, naming the rank.

- About message sizes: real ranks over Gloo (torchrun) and MPI (mpirun), rank 1 bypasses the wire
  format and sends a forged size pair straight through the communicator; rank 0 runs the
  transport's ``gather`` and refuses before allocating.
- About its end-of-round report: rank 1 of a real torchrun job claims more correct predictions
  than test samples; rank 0 ends the job with one line instead of pooling the numbers.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import BIN, REPO, _env
from htfl_dist.errors import ProtocolError
from htfl_dist.runtime.transport import checked_sizes

HOSTILE = '''
import sys
import numpy as np
import torch
from htfl_dist.errors import ProtocolError
from htfl_dist.runtime.wire import encode

launcher, header_len, body_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bound = int(sys.argv[4]) if len(sys.argv) > 4 else None  # what the protocol lets rank 1 send
if launcher == "torchrun":
    import os
    import torch.distributed as dist
    from htfl_dist.runtime.bootstrap import detect_launch, store_address
    from htfl_dist.runtime.transport import TorchTransport
    launch = detect_launch()
    transport = TorchTransport("gloo", launch.rank, 2, torch.device("cpu"), 30.0, store_address(launch))
    send = lambda sizes: dist.send(torch.tensor(sizes, dtype=torch.int64), dst=0)
else:
    from mpi4py import MPI
    from htfl_dist.runtime.transport import MPITransport
    transport = MPITransport(MPI.COMM_WORLD)
    send = lambda sizes: MPI.COMM_WORLD.Send(np.array(sizes, dtype=np.int64), dest=0, tag=1)
transport.max_message_bytes = 1 << 20
if transport.rank == 1:
    send([header_len, body_len])  # then nothing: a liar need not follow up
    sys.exit(0)
try:
    transport.gather(encode((), {}), [None, bound])
except ProtocolError as exc:
    print(f"refused: {exc}", flush=True)
    sys.exit(0)
print("accepted", flush=True)
'''


@pytest.mark.parametrize("sizes", [(-1, 0), (1, -5), (0, 0), (1, 1 << 32), (1 << 40, 0)])
def test_announced_sizes_are_checked_against_the_limit(sizes):
    with pytest.raises(ProtocolError, match=r"rank 3 announced .* refused before allocating .*max_message_mb=1"):
        checked_sizes(list(sizes), 3, 1 << 20)


def test_sizes_within_the_limit_pass():
    assert checked_sizes([3, (1 << 20) - 24], 2, 1 << 20) == (3, (1 << 20) - 24)


def _hostile_command(tmp_path, launcher: str) -> list[str]:
    """Two real ranks running HOSTILE under ``launcher`` (the caller appends its arguments)."""
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(script)]
    return [shutil.which("mpirun", path=str(BIN)) or "mpirun", "-n", "2", sys.executable, str(script)]


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
@pytest.mark.parametrize("sizes", [(1, 4 << 30), (-7, 0)])
def test_rank_zero_refuses_a_forged_size_from_a_real_rank(tmp_path, launcher, sizes):
    command = _hostile_command(tmp_path, launcher)
    result = subprocess.run([*command, launcher, *map(str, sizes)], cwd=REPO, env=_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"refused: rank 1 announced a message of {sizes[0]} header values and {sizes[1]} body bytes" \
        in result.stdout, result.stdout + result.stderr
    assert "accepted" not in result.stdout


# --------------------------------------------------------------------------- lying end-of-round reports

LYING_REPORTER = '''
import os
import sys

from htfl_dist.main import main
from htfl_dist.runtime import loop

honest = loop.evaluate_clients


def inflated(*args, **kwargs):
    """Rank 1 claims more correct predictions than it has test samples."""
    rows = honest(*args, **kwargs)
    return {cid: [samples + 5.0, head, samples, *shares] for cid, (correct, head, samples, *shares) in rows.items()}


if os.environ.get("RANK") == "1":
    loop.evaluate_clients = inflated
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.launch
def test_rank_zero_refuses_an_impossible_report_from_a_real_rank(tmp_path, cache_dir):
    """A client rank reports evaluation counts that cannot be true (correct > samples): rank 0
    names it and its clients, and the job ends, instead of pooling an accuracy above 100 %."""
    script = tmp_path / "liar.py"
    script.write_text(LYING_REPORTER)
    command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=3", str(script),
               "--config", str(REPO / "configs" / "smoke.yaml"), "--out", str(tmp_path / "run"),
               f"data.cache_dir={cache_dir}", "rounds=1", "runtime.placement=round_robin"]
    result = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert "rank 1 (clients [0, 2, 4]) reported an impossible evaluation row for client 0" in result.stderr, \
        result.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or \
        (tmp_path / "run" / "metrics.jsonl").read_text() == ""


@pytest.mark.parametrize("entries,train_ids,eval_ids,message", [
    ({0: {"train": [[1.0, 10.0]], "eval": [[3.0, 2.0, 5.0, 0.75]]}}, [0], [0], None),
    ({0: {"train": [], "eval": [[5.0, 5.0, 5.0, 1.0]]}}, [], [0], None),  # every test sample right, by both
    ({0: {"train": [], "eval": [[5.0, 5.0, 5.0, float("nan")]]}}, [], [0], None),  # one class: no AUC
    ({0: {"train": [[float("nan"), 10.0]], "eval": []}}, [0], [], None),  # diverged training is real
    ({0: {"train": [[1.0, 10.5]], "eval": []}}, [0], [], "impossible training row"),
    ({0: {"train": [], "eval": [[6.0, 2.0, 5.0, 0.5]]}}, [], [0], "impossible evaluation row"),
    ({0: {"train": [], "eval": [[3.0, -1.0, 5.0, 0.5]]}}, [], [0], "impossible evaluation row"),
    ({0: {"train": [], "eval": [[3.0, 2.0, float("inf"), 0.5]]}}, [], [0], "impossible evaluation row"),
    ({0: {"train": [], "eval": [[3.0, 2.0, 5.0, 1.5]]}}, [], [0], "impossible evaluation row"),  # AUC > 1
    ({0: {"train": [], "eval": [[3.0, 2.0, 5.0, 0.5, float("nan"), 0.4]]}}, [], [0], None),  # no trained class tested
    ({0: {"train": [], "eval": [[3.0, 2.0, 5.0, 0.5, 1.5, 0.4]]}}, [], [0], "impossible evaluation row"),
    ({0: {"train": [], "eval": [[3.0, 2.0, 5.0, 0.5, 0.6, -0.1]]}}, [], [0], "impossible evaluation row"),
    ({0: {"train": [[1.0, 10.0]], "eval": []}}, [0, 2], [], "expected \\[0, 2\\]"),
    ({7: {"train": [[1.0, 10.0]], "eval": []}}, [0], [], "training for clients \\[7\\]"),
    ({0: {"train": [], "eval": [[3.0, 2.0, 5.0, 0.5]]}}, [], [], "evaluation for \\[0\\]"),
])
def test_report_rows_are_checked(entries, train_ids, eval_ids, message):
    import torch

    from htfl_dist.runtime.screening import check_rank_report

    as_tensors = {cid: {key: torch.tensor(rows, dtype=torch.float64).reshape(len(rows), -1 if rows else 0)
                        for key, rows in entry.items()} for cid, entry in entries.items()}
    if message is None:
        check_rank_report(as_tensors, train_ids, eval_ids)
    else:
        with pytest.raises(ProtocolError, match=message):
            check_rank_report(as_tensors, train_ids, eval_ids)


@pytest.mark.parametrize("values,ok", [([1.5, 4096.0, 0.0], True), ([0.0, 0.0, 1.0], True),
                                       ([-1.0, 0.0, 0.0], False), ([1.0, 3.5, 0.0], False),
                                       ([1.0, 0.0, 2.0], False), ([float("nan"), 0.0, 0.0], False),
                                       ([float("inf"), 0.0, 0.0], False)])
def test_rank_rows_are_checked(values, ok):
    from htfl_dist.runtime.screening import check_rank_row

    if ok:
        check_rank_row(values)
    else:
        with pytest.raises(ProtocolError, match="impossible rank row"):
            check_rank_row(values)


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_rank_zero_refuses_more_than_the_protocol_allows(tmp_path, launcher):
    """5000 body bytes are far under runtime.max_message_mb, but this rank's clients can send at
    most 1000 bytes this round: refused before allocating."""
    command = _hostile_command(tmp_path, launcher)
    result = subprocess.run([*command, launcher, "1", "5000", "1000"], cwd=REPO, env=_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "refused: rank 1 announced a message of 1 header values and 5000 body bytes; refused before " \
           "allocating it: what it hosts can send at most 1000 bytes" in result.stdout, result.stdout + result.stderr
