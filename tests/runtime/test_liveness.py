"""The liveness channel against a real TCP store in this process: ranks are played by Liveness
objects (rank 0, the watcher) and by plain store counters that do or do not move."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from htfl_dist.runtime.liveness import Liveness as _Liveness
from htfl_dist.runtime.liveness import StoreAddress, open_store


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def address():
    address = StoreAddress("127.0.0.1", _free_port(), hosted_by_rank0=False, prefix="test")
    server = open_store(address, 0, 4, 10.0, serve=True)  # the agent's store
    yield address
    for member in MEMBERS:  # quiet their threads before the store goes
        member.finish()
    MEMBERS.clear()
    time.sleep(0.3)
    del server


MEMBERS: list = []


def Liveness(*args, **kwargs):
    member = _Liveness(*args, **kwargs)
    MEMBERS.append(member)
    return member


class Peer:
    """A rank that beats (or stops beating) through the store, like Liveness's thread does."""

    def __init__(self, address: StoreAddress, rank: int) -> None:
        self.store = open_store(address, rank, 4, 10.0, serve=False)
        self.rank, self.beating = rank, True
        threading.Thread(target=self._beat, daemon=True).start()
        MEMBERS.append(self)

    def finish(self) -> None:
        self.beating = False

    def _beat(self) -> None:
        while True:
            if self.beating:
                try:
                    self.store.add(f"liveness/beat/{self.rank}", 1)
                except Exception:
                    return
            time.sleep(0.1)


def describe(rank: int) -> str:
    return "rank 0 (server)" if rank == 0 else f"rank {rank} (clients [{rank}, {rank + 10}])"


def test_silent_peers_are_those_whose_counter_stands_still(address):
    watcher = Liveness(address, 0, 4, timeout_s=1.0)  # beats every 0.2 s
    alive, stopped, done = Peer(address, 1), Peer(address, 2), Peer(address, 3)
    stopped.beating = False
    done.beating = False
    done.store.set("liveness/done/3", "1")  # finished cleanly: its silence is no failure
    time.sleep(0.3)
    assert watcher.silent_peers(observe_s=0.6) == [2]
    del alive


def test_the_watcher_names_the_silent_rank_once_after_the_timeout(address):
    watcher = Liveness(address, 0, 3, timeout_s=1.0)
    Peer(address, 1)
    hung = Peer(address, 2)
    lines: list[str] = []
    began = time.monotonic()
    watcher.watch(describe, lines.append)
    time.sleep(0.5)
    assert lines == []  # everybody beats
    hung.beating = False
    stopped_at = time.monotonic()
    while not lines and time.monotonic() - began < 10:
        time.sleep(0.05)
    assert len(lines) == 1
    assert lines[0].startswith("htfl_dist: rank 2 (clients [2, 12]) stopped answering (no heartbeat for 1 s")
    assert lines[0].endswith("(seen by rank 0 (server))")
    assert 0.6 <= time.monotonic() - stopped_at < 2.5  # the timeout, give or take a poll and a beat
    time.sleep(0.5)
    assert len(lines) == 1  # said once


def test_rank_one_watches_the_server_and_the_others_watch_nobody(address):
    assert Liveness(address, 0, 4, 1.0).watched_ranks() == [1, 2, 3]
    assert Liveness(address, 1, 4, 1.0).watched_ranks() == [0]
    assert Liveness(address, 2, 4, 1.0).watched_ranks() == []


def test_one_report_per_job(address):
    first, second = Liveness(address, 0, 3, 1.0), Liveness(address, 1, 3, 1.0)
    assert not second.someone_reported()
    assert first.claim_report()
    assert second.someone_reported()
    assert not second.claim_report()


def test_after_a_failure_rank_zero_names_the_dead_peer_and_the_others_stay_quiet(address):
    server, client = Liveness(address, 0, 3, 0.5), Liveness(address, 1, 3, 0.5)
    dead = Peer(address, 2)
    time.sleep(0.3)
    dead.beating = False
    server.describe = client.describe = describe
    line = server.lost_peers_line("rank 0 (server)", "RuntimeError")
    assert line is not None and line.startswith("htfl_dist: rank 2 (clients [2, 12]) stopped answering")
    assert line.endswith("(seen by rank 0 (server): RuntimeError)")
    assert client.lost_peers_line("rank 1", "RuntimeError") == ""  # rank 0 names client ranks
    assert server.claim_report()
    assert client.lost_peers_line("rank 1", "RuntimeError") == ""  # reported already


def test_a_failure_with_every_peer_alive_is_this_ranks_own(address):
    server = Liveness(address, 0, 3, 0.5)
    Liveness(address, 1, 3, 0.5)
    Liveness(address, 2, 3, 0.5)
    assert server.lost_peers_line("rank 0 (server)", "ValueError") is None


def test_a_finished_rank_does_not_take_its_peers_exit_for_a_failure(address):
    """After the run ends (or checkpoints on SIGTERM) ranks exit one by one: a rank still in its
    SIGTERM probe must not name the peers that left before it."""
    client = Liveness(address, 1, 3, 0.5)
    Peer(address, 0).beating = False
    Peer(address, 2).beating = False
    client.describe = describe
    client.finish()
    assert client.lost_peers_line("rank 1", "SIGTERM from the launcher") is None
