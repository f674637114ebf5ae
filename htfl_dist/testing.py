"""The conformance checks every algorithm is held to, for a plugin's own test suite as for ours.

An algorithm registered anywhere (in this package or in a plugin, ``register_algorithm``) is
checked by name, on a small real run: two rounds of the smoke config (6 HtCNN8 clients on 2 % of
Fashion-MNIST, ``SMALL_RUN``) with the overrides its registration names
(``ConformanceHints.overrides``). What is checked:

- its registration: the capability flags agree with the classes, the hints name what exists
  (``check_registration``);
- declared payloads: what it sends is what it declares, every upload field bounded by
  ``max_rows``, a download with every declared field (``check_declared_payloads``);
- model parameters travel only where it is registered as sharing them
  (``check_parameters_travel_as_registered``);
- state round trip: server state and client modules through ``torch.load(weights_only=True)``,
  as checkpoints go (``check_state_round_trip``);
- bytes against theory: the floats each client uploads are the paper's count
  (``theory_upload_floats``), and two rounds send that count plus at most the wire's framing
  (``check_bytes_against_theory``);
- 1 process = 3 ranks: two rounds in one process equal two rounds on 3 torchrun ranks (Gloo),
  every metrics key but wall times and measured bytes, which differ by one message header per
  rank (``check_world_size_invariance``). The only check that starts processes.

A plugin's suite runs them all with one parametrised test (docs/adding-an-algorithm.md):

    from htfl_dist.testing import conformance_cases

    @pytest.mark.parametrize("case", conformance_cases(["myfedper"]))
    def test_conformance(case, tmp_path):
        case(tmp_path)

Each check is also a function of its own, for a suite that plays the runs itself (ours:
tests/e2e/test_conformance.py). A failed check raises ``ConformanceError`` (an AssertionError).
This module never imports pytest at import time: only ``conformance_cases`` does.
"""
from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from htfl_dist.algorithms import ServerAlgorithm, get_algorithm, is_algorithm
from htfl_dist.algorithms.registry import ConformanceHints, has_batched_path, installs_knowledge
from htfl_dist.conformance_runs import (
    SMALL_RUN,
    ConformanceError,
    check_bytes_against_theory,
    check_world_size_invariance,
    framing_bytes,
    hints,
    launch_env,
    launch_run,
    play_run,
    require,
    run_arguments,
    run_overrides,
)
from htfl_dist.errors import ConfigError
from htfl_dist.payload import Payload, max_message_bytes
from htfl_dist.resolution import resolved_config
from htfl_dist.runtime.loop import Federation, RunContext, start
from htfl_dist.runtime.records import RoundOutcome
from htfl_dist.runtime.screening import LeftOut
from htfl_dist.runtime.session import Session, checked_config
from htfl_dist.runtime.startup import build_server
from htfl_dist.runtime.transport import LocalTransport
from htfl_dist.runtime.wire import BROADCAST_ENTRY, Encoded, decode, encode
from htfl_dist.seeding import torch_generator

__all__ = [
    "CHECKS", "SMALL_RUN", "ConformanceCase", "ConformanceError", "ConformanceHints", "PlayedRound",
    "check_bytes_against_theory", "check_declared_payloads", "check_parameters_travel_as_registered",
    "check_registration", "check_state_round_trip", "check_sums_reproduce_update",
    "check_world_size_invariance", "conformance_cases", "framing_bytes", "launch_env", "launch_run", "play_one_round",
    "play_run", "run_overrides",
]

CHECKED_CLIENTS = (0, 1)
"""The clients the one-round checks train by hand."""

def _server(session: Session) -> ServerAlgorithm:
    """The played session's server (the checks play in one process, which is rank 0)."""
    server = session.server
    if server is None:
        raise ConformanceError("the checks' federation has no server (it is not rank 0)")
    return server


def _same(a: Payload, b: Payload) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def _weights_only(state: Any) -> Any:
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)``, as checkpoints go."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --------------------------------------------------------------------------- the registration


def check_registration(name: str) -> None:
    """The capability flags agree with the classes (``register_algorithm`` refuses a registration
    that contradicts them; this holds an entry put in the registry any other way to it too), a
    ``ranks_covered_by`` names another registered algorithm whose launch is checked somewhere, and
    the hints' overrides load on the checks' run."""
    entry = get_algorithm(name)
    require(entry.evaluation_installs_knowledge == installs_knowledge(entry.client),
             f"{name}: evaluation_installs_knowledge={entry.evaluation_installs_knowledge}, but its client "
             f"{'overrides' if installs_knowledge(entry.client) else 'keeps'} the base prepare_evaluation")
    require(not entry.batched_clients or has_batched_path(entry.client),
             f"{name}: batched_clients=True, but its client's train_group is not a batched path of its train")
    covering = entry.conformance.ranks_covered_by
    if covering:
        require(covering != name, f"{name}: ranks_covered_by names the algorithm itself")
        require(is_algorithm(covering),
                 f"{name}: ranks_covered_by={covering!r} names no registered algorithm")
        other = get_algorithm(covering)
        require(not other.conformance.ranks_covered_by,
                 f"{name}: ranks_covered_by={covering!r}, whose own launch is covered by "
                 f"{other.conformance.ranks_covered_by!r}: name that one")
    try:
        resolved_config(None, run_arguments(name, None, ()))
    except ConfigError as exc:
        raise ConformanceError(f"{name}: the checks' run with its conformance overrides "
                               f"{list(entry.conformance.overrides)} does not load: {exc}") from None


# --------------------------------------------------------------------------- one round by hand


@dataclass
class PlayedRound:
    """Round 1 of an algorithm played in this process through the loop's own phases, with the
    two checked clients' uploads passed through the wire in between. What the one-round checks
    read."""

    algorithm: str
    federation: Federation
    session: Session
    message: Encoded
    """The two clients' uploads, encoded as one rank sends them."""
    theory_floats: dict[int, int]
    """Per trained client, its ``theory_upload_floats`` (the paper's count)."""


def play_one_round(name: str, out_dir: str | os.PathLike, *, config_file: str | os.PathLike | None = None,
                   overrides: Sequence[str] = ()) -> PlayedRound:
    """Round 1 of ``name`` on the checks' run (``config_file`` and ``overrides`` on top of
    ``run_overrides``), in this process, started as the program starts (the config checked, the
    session built) and played through the loop's phases: the setup, the download, clients 0 and
    1 trained by the train phase (the round's learning rate, the privacy ledger, the batches'
    streams), their uploads encoded (the wire refuses an upload off its declaration) and decoded,
    then the aggregate phase (arrivals, screening, the server step)."""
    file = None if config_file is None else str(config_file)
    config = checked_config(file, run_arguments(name, config_file, overrides), world_size=1)
    federation = start(RunContext(config, LocalTransport(), torch.device("cpu"), Path(out_dir)))
    session = federation.session
    federation.play_setup()
    knowledge = federation.knowledge()
    share = federation.training.train({client_id: 0 for client_id in CHECKED_CLIENTS}, knowledge, 0)
    theory = {client_id: int(session.client_algorithm.theory_upload_floats(session.clients[client_id]))
              for client_id in CHECKED_CLIENTS}
    message = encode(session.upload_spec, share.uploads)
    received = decode(session.upload_spec, message)
    outcome = RoundOutcome(0, list(CHECKED_CLIENTS), evaluated=False)
    left_out = LeftOut(1)
    federation.aggregate(outcome, received, left_out)
    require(not outcome.skipped, f"{name}: the server refused the uploads of clients {outcome.skipped}")
    return PlayedRound(name, federation, session, message, theory)


def check_declared_payloads(played: PlayedRound) -> None:
    """The download carries every declared field; every upload field declares ``max_rows`` (rank 0
    refuses, before allocating, a message larger than the declared fields allow: without it only
    ``runtime.max_message_mb`` bounds it), and the two clients' real uploads fit the bound for two
    entries. (Uploads off their declaration were already refused when the round was played.)"""
    name, session = played.algorithm, played.session
    sent = encode(session.download_spec, {BROADCAST_ENTRY: _server(session).download()})
    received = set(decode(session.download_spec, sent)[BROADCAST_ENTRY])
    declared = {field.name for field in session.download_spec}
    require(received == declared, f"{name}: the download carries {sorted(received)}, declared {sorted(declared)}")
    unbounded = [field.name for field in session.upload_spec if field.max_rows is None]
    require(not unbounded, f"{name}: upload fields without max_rows: {unbounded}")
    bound = max_message_bytes(session.upload_spec, len(CHECKED_CLIENTS))
    if bound is None:
        raise ConformanceError(f"{name}: an upload field declares no max_rows")
    require(played.message.nbytes <= bound,
             f"{name}: two uploads take {played.message.nbytes} bytes, more than their declaration allows ({bound})")


def _class_knowledge_only(payload: Payload) -> bool:
    """Every float tensor has one row per class id sent with it: class knowledge (prototypes,
    logits), not a model part (a head, a shared model, a generator travel as unindexed rows)."""
    floats = [tensor for tensor in payload.values() if tensor.is_floating_point()]
    class_ids = payload.get("class_ids")
    return all(class_ids is not None and tensor.shape[0] == class_ids.shape[0] for tensor in floats)


def check_parameters_travel_as_registered(played: PlayedRound) -> None:
    """Model parameters travel only for algorithms registered as sharing them
    (``shares_parameters``, where the method's paper shares them); every other one sends class
    knowledge only, and one registered as sharing them sends some."""
    name, session = played.algorithm, played.session
    payloads = [*decode(session.upload_spec, played.message).values(), _server(session).download()]
    class_knowledge = all(_class_knowledge_only(payload) for payload in payloads)
    if session.entry.shares_parameters:
        require(not class_knowledge, f"{name} is registered as sharing parameters but sends none")
    else:
        require(class_knowledge, f"{name} sends more than class knowledge; register it with shares_parameters=True "
                                  f"only if its paper shares model parameters")


def check_state_round_trip(played: PlayedRound) -> None:
    """The server's state, loaded into a fresh server through ``torch.load(weights_only=True)``,
    gives the same download; every client's modules come back equal through the same load."""
    name, session = played.algorithm, played.session
    server = _server(session)
    before = server.download()
    fresh = build_server(session.entry, session.context, session.config, {})
    try:
        state = _weights_only(server.state_dict())
    except Exception as exc:  # pickle.UnpicklingError names the type weights_only refuses
        raise ConformanceError(f"{name}: server state_dict() does not load with weights_only=True: {exc}") from exc
    fresh.load_state_dict(state)
    require(_same(fresh.download(), before), f"{name}: a server loaded from the state sends another download")
    for client_id in CHECKED_CLIENTS:
        for module_name, module in session.clients[client_id].modules.items():
            require(_same(_weights_only(module.state_dict()), module.state_dict()),
                     f"{name}: client {client_id}'s module {module_name!r} does not round-trip")


def summed_contributions(played: PlayedRound) -> tuple[dict[str, torch.Tensor], int] | None:
    """The two checked clients' contributions summed (float64), each checked against the
    server's ``summed_fields``; None for a server that reads each upload."""
    name, session = played.algorithm, played.session
    fields = session.entry.server.summed_fields(session.context) if session.entry.sums_only else None
    if fields is None:
        return None
    uploads = decode(session.upload_spec, played.message)
    sums = {key: torch.zeros(shape, dtype=torch.float64) for key, shape in fields.items()}
    for client_id in sorted(uploads):
        addend = session.entry.server.contribution(session.context, uploads[client_id])
        require(set(addend) == set(fields), f"{name}: client {client_id}'s contribution has {sorted(addend)}, "
                                            f"summed_fields declares {sorted(fields)}")
        for key, tensor in addend.items():
            require(tuple(tensor.shape) == fields[key] and tensor.is_floating_point(),
                    f"{name}: contribution {key!r} is {tensor.dtype} {tuple(tensor.shape)}, declared {fields[key]}")
            sums[key] += tensor.double()
    return sums, len(uploads)


def check_sums_reproduce_update(played: PlayedRound) -> None:
    """A server that declares ``summed_fields`` gives, from the sum of the two clients'
    contributions, the download ``update`` gives from their uploads (within float32 rounding):
    what secure aggregation and pre-summed uploads rely on. Nothing to check for other servers."""
    name, session = played.algorithm, played.session
    summed = summed_contributions(played)
    if summed is None:
        return
    sums, uploaders = summed
    state = _weights_only(_server(session).state_dict())
    by_uploads = build_server(session.entry, session.context, session.config, {})
    by_sums = build_server(session.entry, session.context, session.config, {})
    by_uploads.load_state_dict(state)
    by_sums.load_state_dict(state)
    seed = session.config.seed
    by_uploads.update(decode(session.upload_spec, played.message), 1, torch_generator(seed, "server", 1))
    by_sums.update_from_sums(sums, uploaders, 1, torch_generator(seed, "server", 1))
    expected, got = by_uploads.download(), by_sums.download()
    require(set(expected) == set(got), f"{name}: update_from_sums downloads {sorted(got)}, update {sorted(expected)}")
    for key, tensor in expected.items():
        close = tensor.shape == got[key].shape and torch.allclose(got[key].double(), tensor.double(),
                                                                  rtol=1e-5, atol=1e-6)
        require(close, f"{name}: update_from_sums gives another {key!r} than update on the same uploads")


# --------------------------------------------------------------------------- the cases of a suite


CHECKS = ("registration", "declared_payloads", "parameters_travel", "state_round_trip", "sums_reproduce_update",
          "bytes_against_theory", "three_ranks")
"""Every case of one algorithm, in the order they run. (A round whose uploads are all screened out
is not a server's case: the loop skips the server step and keeps the knowledge as it was.)"""

RUN_CHECKS = frozenset({"bytes_against_theory", "three_ranks"})
"""The cases that play a whole run in the test process (``play_run``)."""

_ROUND_CHECKS = {
    "declared_payloads": check_declared_payloads,
    "parameters_travel": check_parameters_travel_as_registered,
    "state_round_trip": check_state_round_trip,
    "sums_reproduce_update": check_sums_reproduce_update,
}

def _fresh(workdir: Path, what: str) -> Path:
    """A new empty directory under ``workdir`` for one run."""
    workdir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{what}-", dir=workdir))


_played: dict[Any, PlayedRound] = {}
_runs: dict[Any, list[dict[str, Any]]] = {}


@dataclass(frozen=True)
class ConformanceCase:
    """One check of one algorithm; call it with a directory to run in. The round played by hand
    and the one-process run are played once per algorithm and process, and shared by its cases
    (an algorithm's cases follow each other, so only the last round played is kept)."""

    algorithm: str
    check: str

    def __call__(self, workdir: str | os.PathLike, *, config_file: str | os.PathLike | None = None,
                 overrides: Sequence[str] = (), imports: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        """Run the check in ``workdir``; ``config_file`` and ``overrides`` change the checks' run
        (for every case of the algorithm alike: the played runs are shared by their settings),
        ``imports`` and ``env`` are the launch's (``launch_run``)."""
        workdir = Path(workdir)
        name = self.algorithm
        key = (get_algorithm(name), None if config_file is None else str(config_file), tuple(overrides))
        if self.check == "registration":
            check_registration(name)
        elif self.check in _ROUND_CHECKS:
            _ROUND_CHECKS[self.check](self._round(key, workdir, config_file, overrides))
        elif self.check == "bytes_against_theory":
            check_bytes_against_theory(self._round(key, workdir, config_file, overrides),
                                       self._run(key, workdir, config_file, overrides))
        elif self.check == "three_ranks":
            single = self._run(key, workdir, config_file, overrides)
            spread = launch_run(name, _fresh(workdir, "3-ranks") / "run", config_file=config_file, overrides=overrides,
                                imports=imports, env=env)
            check_world_size_invariance(single, spread, name=name)
        else:
            raise ValueError(f"no conformance check {self.check!r}; the checks: {', '.join(CHECKS)}")

    def _round(self, key, workdir, config_file, overrides) -> PlayedRound:
        if key not in _played:
            _played.clear()  # one algorithm's round at a time: the next algorithm's cases follow
            _played[key] = play_one_round(self.algorithm, _fresh(workdir, "round"), config_file=config_file,
                                          overrides=overrides)
        return _played[key]

    def _run(self, key, workdir, config_file, overrides) -> list[dict[str, Any]]:
        if key not in _runs:
            _runs[key] = play_run(self.algorithm, _fresh(workdir, "1-process") / "run", config_file=config_file,
                                  overrides=overrides)
        return [dict(row) for row in _runs[key]]


def conformance_cases(names: Iterable[str], *, launch: bool = True, launch_marks: Sequence[Any] = (),
                      run_marks: Sequence[Any] = ()) -> list[Any]:
    """Every conformance case of each algorithm in ``names``, as ``pytest.param`` values for one
    ``@pytest.mark.parametrize("case", ...)`` (ids ``NAME-CHECK``). ``launch=False`` leaves out
    the case that starts processes (``three_ranks``); ``launch_marks`` mark it (our suite's
    ``pytest.mark.launch``), and ``run_marks`` mark the cases that play a whole run in the test
    process (``bytes_against_theory``, ``three_ranks``: our suite's ``pytest.mark.integration``).
    The launching case is also left out for an algorithm registered now whose hints say its
    launches are covered elsewhere (``ConformanceHints.launched``)."""
    import pytest

    params = []
    for name in names:
        for check in CHECKS:
            marks = list(run_marks) if check in RUN_CHECKS else []
            if check == "three_ranks":
                registered = is_algorithm(name)
                if not launch or (registered and not hints(name).launched):
                    continue
                marks += list(launch_marks)
            params.append(pytest.param(ConformanceCase(name, check), id=f"{name}-{check}", marks=marks))
    return params
