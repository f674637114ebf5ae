"""LG-FedAvg: head averaging by hand, client 0's initial head, the head swap before evaluation and
training, the identical-heads check, options, and one real run."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import GROUP, head_row, head_upload, launch_smoke, make_client, make_context

from conftest import SMOKE, maths_only, read_metrics, run_program
from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.errors import ConfigError, ProtocolError
from htfl_dist.models import initial_client_model
from htfl_dist.seeding import torch_generator

# --------------------------------------------------------------------------- server


def _server(feature_dim=2, num_classes=2, **options):
    entry, context = make_context("lgfedavg", feature_dim=feature_dim, num_classes=num_classes, **options)
    return entry.server(context)


def test_sample_weighted_average_by_hand():
    server = _server()  # head Linear(2, 2): 6 parameters
    uploads = {2: head_upload([4, 8, 0, 0, 0, 0], 3), 0: head_upload([0, 0, 0, 0, 0, 4], 1)}
    server.update(uploads, 0, torch_generator(0, "server", 0))
    # (1·[0,0,0,0,0,4] + 3·[4,8,0,0,0,0]) / 4
    torch.testing.assert_close(server.download()["head"], torch.tensor([[3.0, 6.0, 0.0, 0.0, 0.0, 1.0]]))


def test_uniform_average_by_hand():
    server = _server(head_avg="uniform")
    uploads = {0: head_upload([0, 0, 0, 0, 0, 4], 1), 2: head_upload([4, 8, 0, 0, 0, 0], 3)}
    server.update(uploads, 0, torch_generator(0, "server", 0))
    torch.testing.assert_close(server.download()["head"], torch.tensor([[2.0, 4.0, 0.0, 0.0, 0.0, 2.0]]))


def test_initial_global_head_is_client_0s_initial_head():
    entry, context = make_context("lgfedavg")
    torch.manual_seed(123)  # the server must not depend on the global RNG's state
    server = entry.server(context)
    head = server.download()["head"]
    assert head.shape == (1, 4 * 3 + 3)
    torch.testing.assert_close(head, head_row(make_client(context, 0).model.head), rtol=0, atol=0)
    assert not torch.equal(head, head_row(make_client(context, 1).model.head))


def test_the_initial_global_head_follows_model_init():
    entry, context = make_context("lgfedavg")
    context = dataclasses.replace(context, model_init="htfllib")
    head = entry.server(context).download()["head"]
    expected = initial_client_model(GROUP, 0, 0, num_classes=3, feature_dim=4, in_channels=1, image_size=28,
                                    init="htfllib")
    torch.testing.assert_close(head, head_row(expected.head), rtol=0, atol=0)
    assert not torch.equal(head, head_row(make_client(context, 0).model.head))  # make_client: per_client


def test_bad_uploads_are_refused():
    server = _server()
    before = server.download()["head"].clone()
    assert torch.equal(server.download()["head"], before)
    with pytest.raises(ProtocolError, match="num_samples"):
        server.validate_upload(3, head_upload([1, 2, 3, 4, 5, 6], 0))
    with pytest.raises(ProtocolError, match="head rows"):
        server.validate_upload(3, {"head": torch.zeros(2, 6), "num_samples": torch.tensor([5])})
    server.validate_upload(3, head_upload([1, 2, 3, 4, 5, 6], 5))


def test_state_round_trips():
    server = _server()
    server.update({0: head_upload([1, 2, 3, 4, 5, 6], 2)}, 0, torch_generator(0, "server", 0))
    fresh = _server()
    fresh.load_state_dict(server.state_dict())
    assert torch.equal(fresh.download()["head"], torch.tensor([[1.0, 2, 3, 4, 5, 6]]))


# --------------------------------------------------------------------------- client


def _global_head(context, value=0.25):
    return {"head": torch.full((1, context.feature_dim * context.num_classes + context.num_classes), value)}


def test_head_is_replaced_before_evaluation():
    entry, context = make_context("lgfedavg")
    client = make_client(context, 1)
    knowledge = _global_head(context)
    entry.client(context).prepare_evaluation(client, knowledge)
    torch.testing.assert_close(head_row(client.model.head), knowledge["head"])


def test_head_is_replaced_before_training_and_the_trained_head_is_uploaded():
    entry, context = make_context("lgfedavg", lr=0.0)
    client = make_client(context, 1)
    knowledge = _global_head(context)
    result = entry.client(context).train(client, knowledge, 0, torch_generator(0, "batches", 1, 0))
    torch.testing.assert_close(result.upload["head"], knowledge["head"])  # lr 0: the global head comes back
    assert result.upload["num_samples"].tolist() == [9]  # n_i: the whole split, the untrained tail included
    assert result.samples == 8  # batches 4, 4, and a final single sample that is skipped


def test_training_changes_the_head_but_not_the_shared_download():
    """Two clients of one rank load the same downloaded row: training one must not change it."""
    entry, context = make_context("lgfedavg")
    algorithm = entry.client(context)
    knowledge = _global_head(context)
    first = algorithm.train(make_client(context, 0), knowledge, 0, torch_generator(0, "batches", 0, 0))
    assert torch.equal(knowledge["head"], _global_head(context)["head"])
    assert not torch.equal(first.upload["head"], knowledge["head"])
    assert algorithm.theory_upload_floats(make_client(context, 0)) == 4 * 3 + 3
    assert entry.server(context).theory_download_floats() == 4 * 3 + 3


def test_heterogeneous_heads_are_refused():
    entry, context = make_context("lgfedavg", group="htcnn1:fc,htcnn2:fc512")
    with pytest.raises(ConfigError, match="LG-FedAvg shares the head") as info:
        entry.client.check_models(context)
    assert "client 1" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("options,key", [({"head_avg": "median"}, "algo.head_avg"),
                                         ({"compat": "flower"}, "algo.compat"),
                                         ({"head_lr": 1.0}, "algo.head_lr")])
def test_bad_options_name_their_key(options, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_options(get_algorithm("lgfedavg"), options)


@pytest.mark.integration
def test_real_run(single_run):
    rows = launch_smoke(single_run, "lgfedavg")
    assert all(r["test_acc"] == r["test_acc_head"] for r in rows)


@pytest.mark.integration
def test_parking_heads_the_download_replaces_changes_nothing(single_run):
    """LG-FedAvg's parked clients keep their bases but not their heads (the download replaces
    them before any use): with one client resident the run is the all-resident run, bit for bit."""
    expected = launch_smoke(single_run, "lgfedavg")
    parked = launch_smoke(single_run, "lgfedavg", "runtime.resident_clients=1")
    assert [(r["test_acc"], r["train_loss"]) for r in parked] == [(r["test_acc"], r["train_loss"]) for r in expected]


@pytest.mark.launch
def test_a_run_resumed_with_compact_parked_clients_is_the_uninterrupted_run(tmp_path, cache_dir):
    """Round 2's checkpoint holds parked clients without their heads (their records say so); resumed
    into a new run directory, round 3 is the uninterrupted run's."""
    args = ["--config", str(SMOKE), f"data.cache_dir={cache_dir}", "algorithm=lgfedavg", "num_clients=8",
            "join_ratio=0.5", "rounds=3", "checkpoint_every=1", "checkpoint_keep=3", "runtime.resident_clients=2",
            f"runtime.client_scratch_dir={tmp_path / 'scratch'}"]
    result = run_program(["--out", str(tmp_path / "whole"), *args])
    assert result.returncode == 0, result.stderr
    checkpoint = tmp_path / "whole" / "checkpoints" / "round_00002"
    records = [torch.load(path, weights_only=True) for path in sorted(checkpoint.glob("client_*.pt"))]
    assert any(record.get("replaced_by_download") for record in records)  # some were parked when it was written
    result = run_program(["--out", str(tmp_path / "resumed"), *args, "--resume", str(checkpoint)])
    assert result.returncode == 0, result.stderr
    assert maths_only(read_metrics(tmp_path / "resumed")) == maths_only(read_metrics(tmp_path / "whole"))


# --------------------------------------------------------------------------- edges found by a mutmut pass


def test_declared_fields_are_one_head_row_and_one_sample_count():
    from htfl_dist.payload import Field

    entry, context = make_context("lgfedavg")  # Linear(4, 3): 12 + 3 = 15 floats
    head = Field("head", torch.float32, (15,), max_rows=1)
    assert entry.client.upload_fields(context) == (head, Field("num_samples", torch.int64, (), max_rows=1))
    assert entry.server.download_fields(context) == (head,)


def test_upload_checks_have_exact_messages_and_accept_a_count_of_one():
    server = _server()
    with pytest.raises(ProtocolError) as info:
        server.validate_upload(3, {"head": torch.zeros(2, 6), "num_samples": torch.tensor([5])})
    assert str(info.value) == "client 3 sent 2 head rows, expected 1"
    with pytest.raises(ProtocolError) as info:
        server.validate_upload(3, head_upload([1, 2, 3, 4, 5, 6], 0))
    assert str(info.value) == "client 3 sent num_samples=[0], expected one count > 0"
    with pytest.raises(ProtocolError, match=r"num_samples=\[2, 2\]"):
        server.validate_upload(3, {"head": torch.zeros(1, 6), "num_samples": torch.tensor([2, 2])})
    server.validate_upload(3, head_upload([1, 2, 3, 4, 5, 6], 1))  # one sample is a valid client


def test_update_reports_the_uploads_and_how_far_the_head_moved():
    server = _server()
    server.load_state_dict({"head": torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])})
    diagnostics = server.update({0: head_upload([4, 5, 0, 0, 0, 0], 1), 1: head_upload([4, 5, 0, 0, 0, 0], 3)},
                                0, torch_generator(0, "server", 0))
    # new head (4, 5, 0, 0, 0, 0); change ‖(3, 4, 0, …)‖ = 5
    assert diagnostics == {"head_uploads": 2, "head_change": pytest.approx(5.0)}


def test_training_reports_its_loss_and_draws_batches_from_the_given_stream():
    entry, context = make_context("lgfedavg")
    generator = torch_generator(0, "batches", 1, 0)
    before = generator.get_state().clone()
    result = entry.client(context).train(make_client(context, 1), _global_head(context), 0, generator)
    assert isinstance(result.loss_sum, float) and result.loss_sum > 0.0
    assert not torch.equal(generator.get_state(), before)
