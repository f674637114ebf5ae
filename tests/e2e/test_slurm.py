"""The SLURM scripts on a real, throw-away SLURM cluster of two nodes on this machine.

Each node is a network namespace (veth into a bridge in the controller's namespace, so nothing
touches the host's network) with its own UTS and mount namespace: hostname ``node1``/``node2`` and
an /etc/hosts that names every node. slurmctld, one slurmd per node and munged (own key and
socket) run from a temporary directory with their own slurm.conf, spool and state directories;
the ports are the defaults, which cannot clash because every namespace has its own. The nodes
share the host's file system, as cluster nodes share one. Processes are tracked by
proctrack/linuxproc (no cgroup set-up needed): a signal reaches every process of a step, as with
the cgroup tracking of real clusters, so torchrun's workers get SLURM's SIGTERM and torchrun's copy.

SLURM holds a requeued job for about two minutes before it may start again; the test releases it
at once (``scontrol update StartTime=now``) where a cluster would simply wait. Teardown ends every
process in the cluster's namespaces (daemons, slurmstepd, job steps) and munged, then deletes the
namespaces.

Needs root (namespaces) and the Debian packages slurm-wlm and munge; ``launch/setup_env.sh``
installs them when run as root. Elsewhere the tests skip; deselect them with ``-m "not slurm"``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from conftest import REPO, SMOKE, _env, maths_only, read_metrics, run_program

# One throw-away cluster at a time: its nodes live in fixed network namespaces, so under
# pytest-xdist every test here runs on the same worker (``--dist loadgroup``).
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

ROUNDS = 4
NODES = ("node1", "node2")
CPUS_PER_NODE = 2
SUBNET = "10.251.0"  # lives only in the cluster's namespaces
SBIN = "/usr/sbin:/sbin"
TOOLS = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged", "ip", "nsenter", "unshare")


def _path() -> str:
    return f"{os.environ.get('PATH', '')}:{SBIN}"


def _unavailable() -> str | None:
    """Why this machine cannot host the cluster, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and SLURM daemons)"
    missing = [tool for tool in TOOLS if shutil.which(tool, path=_path()) is None]
    return f"needs {', '.join(missing)} (apt-get install slurm-wlm munge iproute2)" if missing else None


def _skip_or_fail(reason: str) -> None:
    """Skip where the machine cannot host the cluster; in CI, which must run this, fail instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"SLURM cluster test: {reason}")
    pytest.skip(f"SLURM cluster test: {reason}")


if (_reason := _unavailable()) is not None and os.environ.get("CI") != "true":
    pytest.skip(f"SLURM cluster test: {_reason}", allow_module_level=True)  # one line for the module


def _ip(*args: str) -> str:
    result = subprocess.run([shutil.which("ip", path=_path()) or "ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def _address(index: int) -> str:
    """Controller .1, node i .10+i."""
    return f"{SUBNET}.{1 if index == 0 else 10 + index}"


@dataclass
class Cluster:
    root: Path
    prefix: str
    env: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def netns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def on_host(self, host: str, *command: str) -> list[str]:
        """``command`` inside ``host``'s network namespace (nsenter keeps /sys, unlike ip netns exec)."""
        return ["nsenter", f"--net=/run/netns/{self.netns(host)}", *command]

    def run(self, *command: str) -> str:
        """A SLURM client command, issued from the controller's network."""
        result = subprocess.run(self.on_host("ctl", *command), env=self.env, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, f"{' '.join(command)}: {result.stderr}"
        return result.stdout

    def submit(self, script: str, out: Path, options: list[str], *args: str) -> tuple[subprocess.Popen, str]:
        """``sbatch --wait`` of a script from slurm/ on both nodes with the smoke config; returns the
        waiting sbatch and the job id."""
        command = ["sbatch", "--wait", "--parsable", f"--nodes={len(NODES)}", *options, f"--output={out}.log",
                   str(REPO / "slurm" / script), str(SMOKE), "--out", str(out), *args]
        process = subprocess.Popen(self.on_host("ctl", *command), env=self.env, cwd=REPO, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        job = process.stdout.readline().strip()
        assert job.isdigit(), process.communicate()[1]
        return process, job


def _network(prefix: str) -> None:
    """A bridge in the controller's namespace, one veth from it into each node's namespace."""
    ctl = f"{prefix}-ctl"
    _ip("netns", "add", ctl)
    _ip("-n", ctl, "link", "add", "br0", "type", "bridge")
    _ip("-n", ctl, "addr", "add", f"{_address(0)}/24", "dev", "br0")
    for device in ("lo", "br0"):
        _ip("-n", ctl, "link", "set", device, "up")
    for index, node in enumerate(NODES, 1):
        netns = f"{prefix}-{node}"
        _ip("netns", "add", netns)
        _ip("-n", ctl, "link", "add", f"v{index}", "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("-n", ctl, "link", "set", f"v{index}", "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{_address(index)}/24", "dev", "eth0")
        for device in ("lo", "eth0"):
            _ip("-n", netns, "link", "set", device, "up")


def _write_config(root: Path) -> Path:
    """slurm.conf, gres.conf (two stand-in GPUs per node for slurm/gpu.sbatch's arithmetic) and hosts.
    KillWait is SLURM's default, 30 s: a cancelled job's ranks checkpoint at the round boundary and
    its script then says so, which on a loaded machine takes more than 10 s."""
    for sub in ("state", "log", *(f"spool/{node}" for node in NODES)):
        (root / sub).mkdir(parents=True)
    nodes = "\n".join(f"NodeName={node} NodeAddr={_address(i)} CPUs={CPUS_PER_NODE} Gres=gpu:2 State=UNKNOWN"
                      for i, node in enumerate(NODES, 1))
    (root / "slurm.conf").write_text(f"""ClusterName=htfltest
SlurmctldHost=ctl({_address(0)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
MinJobAge=4
KillWait=30
{nodes}
PartitionName=batch Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
    (root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
        f"NodeName={','.join(NODES)} Name=gpu File={device}\n" for device in ("/dev/null", "/dev/zero")))
    hosts = [f"{_address(i)} {host}" for i, host in enumerate(("ctl", *NODES))]
    (root / "hosts").write_text("\n".join(["127.0.0.1 localhost", *hosts]) + "\n")
    return root / "slurm.conf"


def _start_daemons(cluster: Cluster, conf: Path) -> None:
    """munged, slurmctld on host ctl, one slurmd per node; each in the foreground of its own process."""
    root = cluster.root
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge = [f"--socket={root}/munge.socket", f"--key-file={key}", f"--pid-file={root}/munged.pid",
             f"--log-file={root}/log/munged.log", f"--seed-file={root}/munged.seed"]
    _daemon(cluster, ["munged", "--foreground", "--force", *munge])
    _wait(lambda: (root / "munge.socket").exists(), "munged's socket", 20)
    hosts = root / "hosts"
    for host, daemon in (("ctl", f"slurmctld -D -f {conf}"),
                         *((node, f"slurmd -D -N {node} -f {conf}") for node in NODES)):
        own_names = f"hostname {host} && mount --bind {hosts} /etc/hosts && exec {daemon}"
        _daemon(cluster, cluster.on_host(host, "unshare", "--uts", "--mount", "sh", "-c", own_names))
    _wait(lambda: cluster.run("sinfo", "-h", "-o", "%T").split() == ["idle"], f"both nodes idle (logs: {root}/log)",
          120)


def _daemon(cluster: Cluster, command: list[str]) -> None:
    cluster.daemons.append(subprocess.Popen(command, env=cluster.env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True))


def _wait(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (AssertionError, OSError, subprocess.SubprocessError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(cluster: Cluster) -> None:
    """End every process in the cluster's namespaces (daemons, slurmstepd, job steps), munged, then the
    namespaces themselves."""
    names = [cluster.netns(host) for host in ("ctl", *NODES)]
    pids = []
    for name in names:
        with contextlib.suppress(RuntimeError):  # a namespace that was never made
            pids += [int(pid) for pid in _ip("netns", "pids", name).split()]
    pids += [daemon.pid for daemon in cluster.daemons]  # munged lives outside the namespaces
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in set(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not _all_gone(pids, cluster.daemons):
            time.sleep(0.2)
    for name in names:
        with contextlib.suppress(RuntimeError):
            _ip("netns", "delete", name)


def _all_gone(pids: list[int], daemons: list[subprocess.Popen]) -> bool:
    """Reaps our own children (a zombie still has /proc/PID); the others are reaped by init."""
    for daemon in daemons:
        daemon.poll()
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    if reason := _unavailable():  # only in CI: elsewhere the module was skipped
        _skip_or_fail(reason)
    root = tmp_path_factory.mktemp("slurm")
    env = {key: value for key, value in _env().items() if not key.startswith("SLURM_")}
    env.update(SLURM_CONF=str(root / "slurm.conf"), PATH=f"{env['PATH']}:{SBIN}")
    cluster = Cluster(root, f"htfl{os.getpid()}", env)
    try:
        try:
            _network(cluster.prefix)
        except RuntimeError as exc:
            _skip_or_fail(f"cannot build the cluster's network ({exc})")
        _start_daemons(cluster, _write_config(root))
        yield cluster
    finally:
        _stop(cluster)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> list[dict]:
    out = tmp_path_factory.mktemp("single")
    result = run_program(["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}",
                         f"rounds={ROUNDS}"])
    assert result.returncode == 0, result.stderr
    return read_metrics(out)


def _same_metrics(rows: list[dict], expected: list[dict]) -> None:
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    for key in ("test_acc", "test_acc_head", "train_loss"):
        assert [r[key] for r in rows] == [r[key] for r in expected], key


def _log(out: Path) -> str:
    return Path(f"{out}.log").read_text()


CPU_RANKS = ["--ntasks-per-node=2", "--cpus-per-task=1"]


def test_cpu_script_on_two_nodes_matches_a_single_process(cluster, reference, tmp_path, cache_dir):
    """Two nodes x two ranks meeting through the c10d rendezvous on node1 give the numbers of one
    process: world-size invariance holds across a real multi-node launch."""
    out = tmp_path / "run"
    sbatch, _ = cluster.submit("cpu.sbatch", out, CPU_RANKS, f"data.cache_dir={cache_dir}", f"rounds={ROUNDS}")
    assert sbatch.wait(timeout=150) == 0, _log(out)
    assert "2 node(s) x 2 rank(s) x 1 thread(s), rendezvous node1:" in _log(out)
    assert "4 ranks via torchrun" in _log(out)
    _same_metrics(read_metrics(out), reference)
    assert not (out / "PREEMPTED").exists()


def test_gpu_script_takes_its_ranks_from_the_allocation_and_a_cancel_ends_it(cluster, reference, tmp_path,
                                                                              cache_dir):
    """The job asks for one GPU per node, --exclusive gives it both (stand-in) GPUs of each node:
    two ranks per node sharing the node's two CPUs. A plain scancel also sends SIGTERM: the ranks
    still checkpoint, but the job stays cancelled. runtime.device=cpu because the stand-ins are not
    GPUs (and the reference ran on the CPU)."""
    out = tmp_path / "run"
    sbatch, job = cluster.submit("gpu.sbatch", out, [], f"data.cache_dir={cache_dir}", f"rounds={ROUNDS}",
                                 "runtime.device=cpu")
    _wait(lambda: f"round 1/{ROUNDS}" in _log(out), "round 1", 120)
    cluster.run("scancel", job)
    sbatch.wait(timeout=60)  # returns once the job is CANCELLED, while its script may still be ending
    _wait(lambda: f"job {job} is " in _log(out) and "not requeued" in _log(out), "the end of the batch script", 180)
    log = _log(out)
    assert "2 node(s) x 2 rank(s) on 2 GPU(s) x 1 thread(s)" in log and "4 ranks via torchrun" in log, log
    assert f"{job} PENDING" not in cluster.run("squeue", "-h", "-o", "%i %T")
    rows = read_metrics(out)
    assert 1 <= len(rows) < ROUNDS and (out / "PREEMPTED").exists()
    assert [r["test_acc"] for r in rows] == [r["test_acc"] for r in reference[:len(rows)]]


def _start_requeued_job_now(cluster: Cluster, job: str, out: Path) -> None:
    """SLURM holds a requeued job for about two minutes (reason BeginTime), where a cluster would
    wait. Release it once the first attempt has left both nodes, and not within the second its
    credential was revoked in: slurmd refuses a new one from that same second."""
    def requeued() -> bool:
        pending = cluster.run("squeue", "-h", "-j", job, "-o", "%T").strip() == "PENDING"
        return "attempt 2" in _log(out) or (pending and cluster.run("sinfo", "-h", "-o", "%T").split() == ["idle"])

    _wait(requeued, "the requeued job", 180)
    if "attempt 2" not in _log(out):
        time.sleep(2)
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")


def test_sigterm_checkpoints_requeues_and_resumes(cluster, reference, tmp_path, cache_dir):
    """scancel --signal=TERM, as a preemption or the early signal delivers it: the ranks checkpoint
    at the round boundary, the script requeues the job, and the second attempt resumes."""
    out = tmp_path / "run"
    sbatch, job = cluster.submit("cpu.sbatch", out, CPU_RANKS, f"data.cache_dir={cache_dir}", f"rounds={ROUNDS}")
    _wait(lambda: f"round 1/{ROUNDS}" in _log(out), "round 1", 120)
    cluster.run("scancel", "--signal=TERM", job)
    _start_requeued_job_now(cluster, job, out)
    assert sbatch.wait(timeout=150) == 0, _log(out)
    log = _log(out)
    assert "preempted: checkpoint after round" in log and f"requeueing job {job}" in log, log
    assert f"job {job} attempt 2" in log, log
    _same_metrics(read_metrics(out), reference)
    assert (out / "summary.json").is_file() and not (out / "PREEMPTED").exists()


def test_a_study_as_one_array_job_gives_the_cells_of_a_local_study(cluster, tmp_path, cache_dir):
    """python -m htfl_dist.study --slurm --wait: one array job over the study's cells, both at once
    (a node each, two ranks through slurm/cpu.sbatch), then the table; every cell's metrics equal
    the same study's run locally, one process per cell."""
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({"base": str(SMOKE), "set": {"rounds": 2, "data.cache_dir": str(cache_dir)},
                                     "grid": {"algorithm": ["fedproto", "local"]}}))
    program = [sys.executable, "-m", "htfl_dist.study", str(study), "--progress-every", "0"]
    local = subprocess.run([*program, "--out", str(tmp_path / "local"), "--jobs", "2"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    array = subprocess.run(cluster.on_host("ctl", *program, "--out", str(tmp_path / "array"), "--slurm", "--wait",
                                           "--sbatch", "--nodes=1 --ntasks-per-node=2 --cpus-per-task=1"),
                           cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=300)
    assert array.returncode == 0, array.stdout + array.stderr
    assert "submitted array job" in array.stdout and "| fedproto | 1 |" in array.stdout, array.stdout
    logs = sorted((tmp_path / "array" / "slurm").glob("array-0-task-*.log"))
    assert len(logs) == 2 and all("1 node(s) x 2 rank(s)" in log.read_text() for log in logs)
    for cell in ("fedproto-seed0", "local-seed0"):
        rows = read_metrics(tmp_path / "array" / "cells" / cell)
        assert len(rows) == 2 and maths_only(rows) == maths_only(read_metrics(tmp_path / "local" / "cells" / cell))
    assert "| 2/2 |" in (tmp_path / "array" / "table.md").read_text()
