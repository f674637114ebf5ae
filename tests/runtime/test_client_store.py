"""runtime.resident_clients: an LRU of resident clients, the others parked, results unchanged.

The unit tests drive ``ClientStore`` with small real models and count what it builds, parks and
unparks; the runs go through the real program and compare metrics with every client resident.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import SMOKE, launch, maths_only, read_metrics, run_smoke
from htfl_dist.algorithms import ClientState
from htfl_dist.errors import HtflError
from htfl_dist.runtime.client_store import ClientStore, client_record

CPU = torch.device("cpu")


class _Builder:
    """Clients with a 3→2 linear model drawn from the client id (as the runtime draws from
    (seed, client id)), an SGD optimizer and, optionally, an algorithm module."""

    def __init__(self, with_module: bool = False, architecture: str = "linear", momentum: float = 0.9) -> None:
        self.with_module = with_module
        self.momentum = momentum
        self.architecture = architecture
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, client_id: int, shell: bool) -> ClientState:
        self.calls.append((client_id, shell))
        torch.manual_seed(client_id)
        if shell:
            with torch.device("meta"):
                model = nn.Linear(3, 2)
            model = model.to_empty(device=CPU)
        else:
            model = nn.Linear(3, 2)
        data = torch.zeros(4, 3)
        client = ClientState(client_id=client_id, architecture=self.architecture, model=model,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=self.momentum),
                             train_x=data, train_y=torch.zeros(4, dtype=torch.long), test_x=data,
                             test_y=torch.zeros(4, dtype=torch.long), device=CPU)
        if self.with_module:
            client.modules["extra"] = nn.Linear(2, 2)
        return client


def _train_step(client: ClientState) -> None:
    """One momentum-SGD step, so both the weights and the optimizer state change."""
    loss = client.model(torch.ones(1, 3)).sum()
    client.optimizer.zero_grad()
    loss.backward()
    client.optimizer.step()


def _store(tmp_path: Path, build: _Builder, resident: int, ids=(0, 1, 2, 3), **kwargs) -> ClientStore:
    return ClientStore(list(ids), build, resident=resident, device=CPU, rank=1, scratch_dir=tmp_path, **kwargs)


def _weights(client: ClientState) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in client.model.parameters()])


def test_all_resident_builds_each_client_when_first_needed_once_and_never_parks(tmp_path):
    build = _Builder()
    store = _store(tmp_path, build, resident=0)
    assert build.calls == []  # nothing built before it is needed
    assert store[2] is store[2] and list(store) == [0, 1, 2, 3] and len(store) == 4
    assert store.peek(0) is store[0] and build.calls == [(2, False), (0, False)]
    for client_id in store:
        store.peek(client_id)
    assert build.calls == [(2, False), (0, False), (1, False), (3, False)]
    assert list(tmp_path.iterdir()) == []  # nothing on disk
    assert 7 not in store
    with pytest.raises(KeyError):
        store[7]


@pytest.mark.parametrize("in_memory", [False, True], ids=["disk", "host-memory"])
def test_a_parked_client_comes_back_exactly_as_it_left(tmp_path, in_memory):
    build = _Builder(with_module=True)
    store = _store(tmp_path, build, resident=2, park_in_memory=in_memory)
    assert build.calls == []  # nothing is built before it is needed
    client = store[0]
    _train_step(client)
    _train_step(client)
    client.modules["extra"].weight.data.fill_(3.0)
    trained = client_record(client)
    store[1], store[2]  # client 0 is the least recently used: parked
    assert store.parked_count == 1 and 0 not in store._resident
    back = store[0]
    assert back is not client and build.calls[-1] == (0, True)  # rebuilt as a shell, not re-initialised
    assert torch.equal(back.model.weight, trained["model"]["weight"])
    assert torch.equal(back.model.bias, trained["model"]["bias"])
    momentum = back.optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, trained["optimizer"]["state"][0]["momentum_buffer"])
    assert torch.equal(back.modules["extra"].weight, torch.full((2, 2), 3.0))
    # it trains on from there exactly as a client that never left
    twin = _Builder(with_module=True)(0, False)
    _train_step(twin)
    _train_step(twin)
    _train_step(twin)
    _train_step(back)
    assert torch.equal(_weights(back), _weights(twin))


def test_the_least_recently_used_client_is_the_one_parked(tmp_path):
    store = _store(tmp_path, _Builder(), resident=2)
    store[0], store[1]
    store[0]  # 1 is now the least recently used
    store[2]
    assert list(store._resident) == [0, 2]


def test_a_client_only_read_is_not_written_when_it_leaves(tmp_path):
    """Evaluation peeks: an unchanged client is rebuilt from its seed or its parked record."""
    build = _Builder()
    store = _store(tmp_path, build, resident=1)
    initial = _weights(store.peek(0)).clone()
    store.peek(1)  # evicts 0, which nobody changed: nothing written
    assert store.parked_count == 0
    assert torch.equal(_weights(store.peek(0)), initial) and build.calls[-1] == (0, False)
    _train_step(store[1])
    store.peek(2)  # 1 was changed: written
    assert store.parked_count == 1
    trained = _weights(store.peek(1)).clone()
    store.peek(3)  # 1 was unparked and only read: not written again
    assert store.parked_count == 1
    assert torch.equal(_weights(store.peek(1)), trained)
    changed = store.peek(1)
    store[1]  # fetched to be changed while resident: written when it leaves
    _train_step(changed)
    store.peek(2)
    assert store.parked_count == 2
    _train_step(store[3])
    trained = _weights(store.peek(3)).clone()  # read while resident after a change: still to be written
    store.peek(0)
    assert store.parked_count == 3 and torch.equal(_weights(store.peek(3)), trained)


def test_freed_memory_goes_back_to_the_system_once_per_limit_evictions(tmp_path, monkeypatch):
    """Parked models' freed blocks fragment glibc's heap (peak RSS 2.4 -> 3.1 GiB at 1000 clients);
    the store trims it once per K evictions, changed or not (every eviction was too slow)."""
    from htfl_dist.runtime import client_store

    trims = []
    monkeypatch.setattr(client_store, "_trim_heap", lambda: trims.append(1))
    store = _store(tmp_path, _Builder(), resident=2, ids=range(8))
    for client_id in range(8):
        _train_step(store[client_id])  # evictions 1..6 once 8 clients have passed through 2 places
    assert len(trims) == 3
    store.peek(0)
    assert len(trims) == 3
    store.peek(1)  # the 8th eviction
    assert len(trims) == 4
    store.peek(2)
    store.peek(3)  # the 10th eviction, of client 1, only read: nothing written, still trimmed
    assert len(trims) == 5 and store.parked_count == 8


def test_records_and_restores_reach_parked_and_unbuilt_clients(tmp_path):
    """What checkpoints use: every client's record without making it resident, and restoring a
    record into a client that is not resident."""
    build = _Builder()
    store = _store(tmp_path, build, resident=1)
    fresh = _Builder()(3, False)
    assert torch.equal(store.record(3)["model"]["weight"], fresh.model.weight)  # never built: its seed's
    _train_step(store[0])
    store[1]
    parked = store.record(0)
    assert 0 not in store._resident  # reading a record does not make it resident
    record = client_record(_Builder()(0, False))
    record["model"]["weight"] = torch.full((2, 3), 5.0)
    store.restore(2, record | {"client_id": 2}, "checkpoint /x")
    assert torch.equal(store[2].model.weight, torch.full((2, 3), 5.0))
    assert not torch.equal(parked["model"]["weight"], fresh.model.weight)
    store.peek(3)  # resident and unchanged, then restored: the restored weights must be kept
    store.restore(3, record | {"client_id": 3}, "checkpoint /x")
    store.peek(1)
    assert torch.equal(store.peek(3).model.weight, torch.full((2, 3), 5.0))


def test_an_unbounded_store_restores_a_client_it_has_not_built_into_memory(tmp_path):
    """A resumed run with every client resident: a checkpoint's record goes into a shell that
    stays resident (built once, as a shell), and nothing is parked."""
    build = _Builder()
    store = _store(tmp_path, build, resident=0)
    record = client_record(_Builder()(1, False))
    record["model"]["weight"] = torch.full((2, 3), 7.0)
    store.restore(1, record | {"client_id": 1}, "checkpoint /x")
    assert build.calls == [(1, True)]
    assert torch.equal(store[1].model.weight, torch.full((2, 3), 7.0)) and build.calls == [(1, True)]
    assert list(tmp_path.iterdir()) == []


def test_a_record_of_another_architecture_is_refused_with_its_origin(tmp_path):
    store = _store(tmp_path, _Builder(architecture="htcnn1"), resident=1)
    record = client_record(_Builder(architecture="htcnn2")(0, False))
    with pytest.raises(HtflError, match=r"checkpoint /runs/x: client 0 is a htcnn2, config says htcnn1"):
        store.restore(0, record, "checkpoint /runs/x")
    with pytest.raises(HtflError, match="holds algorithm modules"):
        _store(tmp_path, _Builder(with_module=True, architecture="htcnn2"), resident=0).restore(0, record, "here")


def test_close_removes_the_scratch_directory(tmp_path):
    store = _store(tmp_path, _Builder(), resident=1)
    _train_step(store[0])
    store[1]
    (scratch,) = tmp_path.iterdir()
    assert [p.name for p in scratch.iterdir()] == ["client_0.pt"]
    store.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.integration
@pytest.mark.parametrize("algorithm", ["fedproto", "lgfedavg", "fedkd"])
def test_a_bounded_store_gives_the_metrics_of_an_all_resident_run(algorithm, tmp_path, cache_dir):
    """8 clients, half of them per round, at most 2 resident: FedProto (evaluation only reads),
    LG-FedAvg (evaluation installs the global head, so evaluated clients change), FedKD (each
    client owns extra modules: the mentee; the smallest HtCNN8 member, as in the conformance runs,
    since the default mentee's SVDs took most of this test's 38 s)."""
    mentee = ("algo.shared_model=htcnn2",) if algorithm == "fedkd" else ()
    common = (f"algorithm={algorithm}", "num_clients=8", "join_ratio=0.5", "rounds=2", *mentee)
    expected = run_smoke("single", 1, tmp_path / "all", cache_dir, *common)
    rows = run_smoke("single", 1, tmp_path / "bounded", cache_dir, *common, "runtime.resident_clients=2",
                     f"runtime.client_scratch_dir={tmp_path / 'scratch'}")
    assert maths_only(rows) == maths_only(expected)
    assert list((tmp_path / "scratch").iterdir()) == []  # the parked records are gone at the end


@pytest.mark.launch
def test_bounded_ranks_checkpoint_and_resume_like_one_uninterrupted_process(tmp_path, cache_dir):
    """Three ranks keeping one client each resident, stopped after round 2 and resumed on two
    ranks: the metrics of one process that kept every client and never stopped."""
    common = ("num_clients=8", "join_ratio=0.5", "checkpoint_every=1")
    expected = run_smoke("single", 1, tmp_path / "reference", cache_dir, *common)
    out = tmp_path / "bounded"
    run_smoke("torchrun", 3, out, cache_dir, *common, "rounds=2", "runtime.resident_clients=1")
    result = launch("torchrun", 2, ["--config", str(SMOKE), "--out", str(out), "--resume", "auto",
                                    f"data.cache_dir={cache_dir}", *common, "runtime.resident_clients=3"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert maths_only(read_metrics(out)) == maths_only(expected)


@pytest.mark.parametrize("init", ["htfllib", "per_client"])
def test_every_client_starts_from_its_initial_model_however_it_is_built(init, tmp_path, cache_dir):
    """With model.init=htfllib a member's weights are drawn once and copied into the next clients
    of that member (copied from the member's template); every client must still hold exactly what
    ``initial_client_model`` gives it, both with every client resident and when parked clients
    are rebuilt (12 clients: HtCNN8's members 0-3 twice)."""
    from htfl_dist.config import load_config
    from htfl_dist.models import initial_client_model
    from htfl_dist.runtime.session import RunContext, Session
    from htfl_dist.runtime.transport import LocalTransport

    for resident in (0, 3):
        config = load_config(SMOKE, [f"data.cache_dir={cache_dir}", "num_clients=12", f"model.init={init}",
                                     f"runtime.resident_clients={resident}"])
        session = Session(RunContext(config, LocalTransport(), CPU, tmp_path / f"{init}-{resident}"))
        info = session.partition
        for client_id in range(12):
            expected = initial_client_model(config.model.group, client_id, config.seed, num_classes=info.num_classes,
                                            feature_dim=config.model.feature_dim, in_channels=info.in_channels,
                                            image_size=info.image_size, init=init).state_dict()
            got = session.clients.peek(client_id).model.state_dict()
            assert list(got) == list(expected)
            assert all(torch.equal(got[name], expected[name]) for name in expected), (init, resident, client_id)
        session.clients.close()


def test_a_copied_model_has_storage_of_its_own_and_keeps_its_ties():
    """Shells and htfllib clients are copies of one template per architecture: a copy that shared
    the template's storage would let one client's training move every later client's start."""
    from htfl_dist.runtime.startup import copy_of_model

    template = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 3))
    template[2].weight = torch.nn.Parameter(template[0].weight.detach().t().clone())  # untied: own tensor
    template[0].bias.requires_grad_(False)
    with torch.no_grad():
        template[1].running_mean.fill_(0.5)
    for with_weights in (True, False):
        copied = copy_of_model(template, with_weights=with_weights)
        pairs = list(zip(template.state_dict().values(), copied.state_dict().values(), strict=True))
        assert all(a.data_ptr() != b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype for a, b in pairs)
        assert [p.requires_grad for p in copied.parameters()] == [True, False, True, True, True, True]
        if with_weights:
            assert all(torch.equal(a, b) for a, b in pairs)
    copied = copy_of_model(template, with_weights=True)
    assert torch.equal(copied[1].running_mean, torch.full((2,), 0.5))
    tied = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    tied[1].weight = tied[0].weight
    for with_weights in (True, False):
        again = copy_of_model(tied, with_weights=with_weights)
        assert again[1].weight is again[0].weight and again[0].weight is not tied[0].weight


@pytest.mark.parametrize("resident", [0, 2])
def test_a_client_that_keeps_nothing_leaves_memory_once_the_caller_is_finished_with_it(tmp_path, resident):
    """FedAvg over the whole model with plain SGD: nothing of a client outlives the next download,
    so finished_with lets it go; it comes back as a new zeroed shell, and a checkpoint's record of
    it holds nothing but the list of replaced entries. Momentum, an entry the download leaves,
    a module's state, or no declaration of what the download replaces keep the client as it is."""
    everything = lambda client: frozenset({"weight", "bias"})  # noqa: E731
    store = _store(tmp_path / "all", _Builder(momentum=0.0), resident=resident, replaced_by_download=everything)
    first = store[0]
    _train_step(first)
    store.finished_with([0, 3])  # 3 was never built: nothing to let go
    again = store[0]
    assert again is not first and torch.equal(_weights(again), torch.zeros(8))
    store.finished_with([0])
    record = store.record(0)
    assert record["model"] == {} and record["replaced_by_download"] == ["bias", "weight"]
    assert record["optimizer"]["state"] == {}
    keepers = {
        "momentum": _store(tmp_path / "m", _Builder(), resident=resident, replaced_by_download=everything),
        "bias kept": _store(tmp_path / "b", _Builder(momentum=0.0), resident=resident,
                            replaced_by_download=lambda client: frozenset({"weight"})),
        "module": _store(tmp_path / "x", _Builder(with_module=True, momentum=0.0), resident=resident,
                         replaced_by_download=everything),
        "undeclared": _store(tmp_path / "u", _Builder(momentum=0.0), resident=resident),
    }
    for why, kept in keepers.items():
        client = kept[0]
        _train_step(client)
        trained = _weights(client)
        kept.finished_with([0])
        assert kept[0] is client and torch.equal(_weights(kept[0]), trained), why


def test_a_parked_client_keeps_only_what_the_download_does_not_replace(tmp_path):
    """FedAvg-style: the algorithm says the download replaces the weight, so the parked record
    holds the bias and the momentum only (listed as such), the client comes back with a zero
    weight until its next download and everything else as it was, and a checkpoint's read of it
    is the same compact record, which restores the same way."""
    store = _store(tmp_path, _Builder(), resident=1, replaced_by_download=lambda client: frozenset({"weight"}))
    _train_step(store[0])
    bias, momentum = store[0].model.bias.detach().clone(), store[0].optimizer.state_dict()["state"][0]
    store[1]  # parks client 0
    parked = store.record(0)
    assert sorted(parked["model"]) == ["bias"] and parked["replaced_by_download"] == ["weight"]
    back = store[0]
    assert torch.equal(back.model.weight, torch.zeros(2, 3)) and torch.equal(back.model.bias, bias)
    assert torch.equal(back.optimizer.state_dict()["state"][0]["momentum_buffer"], momentum["momentum_buffer"])
    other = _store(tmp_path / "other", _Builder(), resident=0)
    other.restore(0, parked, "checkpoint /x")
    assert torch.equal(other[0].model.weight, torch.zeros(2, 3)) and torch.equal(other[0].model.bias, bias)
    with pytest.raises(HtflError, match="leaves out model entries"):
        other.restore(1, parked | {"client_id": 1, "replaced_by_download": ["gain"]}, "checkpoint /x")


def test_a_fresh_client_whose_whole_model_the_download_replaces_is_a_zeroed_shell(tmp_path):
    """FedAvg: no weights are drawn for a client whose every model entry the next download
    replaces; the first client of the architecture is probed as a shell, later ones go straight
    to it. Where some entry survives (LG-FedAvg's base), clients are built in full."""
    build = _Builder()
    store = _store(tmp_path, build, resident=0, replaced_by_download=lambda client: frozenset({"weight", "bias"}))
    assert torch.equal(store[0].model.weight, torch.zeros(2, 3)) and torch.equal(store[1].model.bias, torch.zeros(2))
    assert build.calls == [(0, True), (1, True)]
    partly = _Builder()
    store = _store(tmp_path, partly, resident=0, replaced_by_download=lambda client: frozenset({"weight"}))
    assert torch.equal(store[0].model.bias, _Builder()(0, False).model.bias)
    store[1]
    assert partly.calls == [(0, True), (0, False), (1, False)]


def test_only_a_model_still_shaped_like_its_template_may_stand_in_for_a_copy_of_it():
    """A released client's model is reused as the next shell only if it is what a copy of the
    template is: a hook, an attribute added or changed, a frozen parameter or a tie an algorithm
    made would otherwise pass to a client that never had them."""
    from htfl_dist.runtime.startup import copy_of_model, same_structure

    template = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.BatchNorm1d(4), nn.Linear(4, 4))

    def copied() -> nn.Sequential:
        model = copy_of_model(template, with_weights=True)
        with torch.no_grad():
            for value in model.state_dict().values():
                value.add_(1)  # values and train/eval mode never matter
        return model.eval()

    assert same_structure(copied(), template)
    changes = {
        "a hook": lambda m: m[0].register_forward_hook(lambda *args: None),
        "an attribute changed": lambda m: setattr(m[1], "p", 0.1),
        "an attribute added": lambda m: setattr(m[3], "scale", 2.0),
        "a frozen parameter": lambda m: m[3].bias.requires_grad_(False),
        "a tie": lambda m: setattr(m[3], "bias", m[2].bias),
        "a parameter dropped": lambda m: m[3].register_parameter("bias", None),
        "a tensor outside the state dict": lambda m: setattr(m[2], "cache", torch.zeros(4)),
        "another shape": lambda m: m.append(nn.ReLU()),
    }
    for what, change in changes.items():
        model = copied()
        change(model)
        assert not same_structure(model, template), what


class _CountedCopies:
    def __init__(self, copy) -> None:
        self.copy, self.calls = copy, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.copy(*args, **kwargs)


@pytest.mark.integration
def test_a_let_go_clients_model_is_the_next_shell_and_the_numbers_do_not_move(tmp_path, cache_dir, monkeypatch):
    """FedAvg over the whole model with plain SGD (clients keep nothing): each client the store
    lets go gives its model to the next fresh client of its architecture instead of a new copy
    of the template, and the run's numbers are those of a run that copies every time."""
    from fedper_parts import FedPerClient, FedPerOptions, FedPerServer

    from htfl_dist.algorithms import register_algorithm, registry
    from htfl_dist.algorithms.blocks.model_part import WHOLE_MODEL
    from htfl_dist.runtime import startup
    from htfl_dist.runtime.simulate import simulate

    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())
    register_algorithm("whole_fedavg", server=type("Server", (FedPerServer,), {"part": WHOLE_MODEL}),
                       client=type("Client", (FedPerClient,), {"part": WHOLE_MODEL}), options=FedPerOptions,
                       summary="FedAvg over the whole model", shares_parameters=True,
                       evaluation_installs_knowledge=True)
    run = ["algorithm=whole_fedavg", "model.group=cnn", "rounds=2", "num_clients=6", "join_ratio=0.5",
           "train.momentum=0", f"data.cache_dir={cache_dir}"]
    copies = _CountedCopies(startup.copy_of_model)
    monkeypatch.setattr(startup, "copy_of_model", copies)
    recycled = simulate(SMOKE, run, out=tmp_path / "recycled")
    recycled_copies = copies.calls
    monkeypatch.setattr(startup.ClientFactory, "take_back", lambda self, client: None)
    copies.calls = 0
    copied = simulate(SMOKE, run, out=tmp_path / "copied")
    # copied: the template's probe, client 0 at start-up, round 1's first new client (none let go yet)
    assert recycled_copies == 3 and copies.calls >= 3 + 6  # then every new client and every test of one
    keys = ("train_loss", "test_acc", "test_auc", "model_change")
    assert [[row[key] for key in keys] for row in recycled] == [[row[key] for key in keys] for row in copied]
