"""A client rank that lies about its message sizes: rank 0 refuses before allocating, naming it.

Real ranks over Gloo (torchrun) and MPI (mpirun): rank 1 bypasses the wire format and sends a
forged size pair straight through the communicator; rank 0 runs the transport's ``gather``.
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
if launcher == "torchrun":
    import os
    import torch.distributed as dist
    from htfl_dist.runtime.transport import TorchTransport
    transport = TorchTransport("gloo", int(os.environ["RANK"]), 2, torch.device("cpu"), 30.0)
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
    transport.gather(encode((), {}))
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


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
@pytest.mark.parametrize("sizes", [(1, 4 << 30), (-7, 0)])
def test_rank_zero_refuses_a_forged_size_from_a_real_rank(tmp_path, launcher, sizes):
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    if launcher == "torchrun":
        command = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(script)]
    else:
        command = [shutil.which("mpirun", path=str(BIN)) or "mpirun", "-n", "2", sys.executable, str(script)]
    result = subprocess.run([*command, launcher, *map(str, sizes)], cwd=REPO, env=_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"refused: rank 1 announced a message of {sizes[0]} header values and {sizes[1]} body bytes" \
        in result.stdout, result.stdout + result.stderr
    assert "accepted" not in result.stdout
