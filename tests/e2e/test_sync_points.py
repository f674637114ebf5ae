"""bench/sync_points.py: a run's host waits by call site. On the CPU nothing waits, but the sites
are the GPU's, so the count is checked here: FedProto's smoke run reads each trained client's
loss sum once (``float`` in ``run_local_training``), 6 clients in its one round, and reads
nothing per step."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, _env

sys.path.insert(0, str(REPO / "bench"))
import sync_points


def test_only_copies_between_the_host_and_a_device_count():
    host, other = torch.zeros(2), torch.zeros(2, device="meta")  # "meta": a device that needs no GPU
    assert sync_points.crosses_devices("aten._to_copy", (host,), {"device": torch.device("meta")})
    assert sync_points.crosses_devices("aten.copy_", (other, host), {})
    assert not sync_points.crosses_devices("aten.copy_", (host, torch.ones(2)), {})
    assert not sync_points.crosses_devices("aten._to_copy", (host,), {"dtype": torch.float64})


@pytest.mark.launch
def test_a_smoke_run_reads_each_clients_loss_once_and_nothing_per_step(tmp_path):
    command = [sys.executable, str(REPO / "bench" / "sync_points.py"), "--top", "100", "--depth", "1", "--",
               "--config", str(REPO / "configs" / "smoke.yaml"), "--out", str(tmp_path / "run"), "rounds=1"]
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.stdout[done.stdout.index("sync_points:"):]
    sites = re.findall(r"^ +(\d+)  (aten\.\w+)\n +(\S+):\d+ (\S+)$", report, flags=re.M)
    assert sites, report
    loss_reads = [int(n) for n, op, path, function in sites
                  if (op, path, function) == ("aten._local_scalar_dense", "htfl_dist/algorithms/training.py",
                                              "run_local_training")]
    assert loss_reads == [6], report  # 6 clients, all of them in round 1 (configs/smoke.yaml)
    # a site that read a value every step would run about 100 times (6 clients, ~17 steps each)
    assert max(int(n) for n, *_ in sites) < 60, report
