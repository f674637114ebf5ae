"""Servers that need only the sum of the round's contributions (``summed_fields``,
``contribution``, ``update_from_sums``): which are, worked examples of the sums and the knowledge
they give (equal to ``update`` on the same uploads), and the rule that keeps a subclass that
rewrites ``update`` out."""
from __future__ import annotations

import pytest
import torch
from helpers import head_upload, make_context

from htfl_dist.algorithms import algorithm_names, get_algorithm
from htfl_dist.algorithms.fedproto import FedProtoServer
from htfl_dist.algorithms.registry import sums_only
from htfl_dist.seeding import torch_generator


def _summed(entry, context, uploads):
    fields = entry.server.summed_fields(context)
    sums = {key: torch.zeros(shape, dtype=torch.float64) for key, shape in fields.items()}
    for client_id in sorted(uploads, reverse=True):  # any order: a sum
        for key, tensor in entry.server.contribution(context, uploads[client_id]).items():
            sums[key] += tensor
    return sums


def test_the_sums_only_servers():
    """Class means (FedProto, FedDistill) and part averages (LG-FedAvg, FML, FedMRL); FedPCL and
    FedGen rewrite update below the sums they inherit, so they read each upload."""
    assert {name for name in algorithm_names() if get_algorithm(name).sums_only} >= {
        "feddistill", "fedmrl", "fedproto", "fml", "lgfedavg"}
    assert not get_algorithm("fedpcl").sums_only and not get_algorithm("fedgen").sums_only
    assert not get_algorithm("fedtgp").sums_only  # trains on every uploaded prototype

    class Rewritten(FedProtoServer):
        def update(self, uploads, round_index, generator):
            return {}

    assert sums_only(FedProtoServer) and not sums_only(Rewritten)


UPLOADS = {
    0: {"class_ids": torch.tensor([0, 2]), "protos": torch.tensor([[1.0, 0.0], [0.0, 2.0]]),
        "counts": torch.tensor([1, 3])},
    1: {"class_ids": torch.tensor([2]), "protos": torch.tensor([[4.0, 4.0]]), "counts": torch.tensor([1])},
}


@pytest.mark.parametrize(("weighted", "class_2"), [
    (True, [1.0, 2.5]),  # (3·(0, 2) + 1·(4, 4)) / 4
    (False, [2.0, 3.0]),  # ((0, 2) + (4, 4)) / 2
])
def test_class_means_from_the_sums_by_hand(weighted, class_2):
    entry, context = make_context("fedproto", num_classes=3, feature_dim=2, weighted=weighted)
    sums = _summed(entry, context, UPLOADS)
    weights = [1.0, 0.0, 4.0] if weighted else [1.0, 0.0, 2.0]
    torch.testing.assert_close(sums["weights"], torch.tensor(weights, dtype=torch.float64))
    from_sums, from_uploads = entry.server(context), entry.server(context)
    assert from_sums.update_from_sums(sums, 2, 0, torch_generator(0, "s"))["global_classes"] == 2.0
    from_uploads.update(UPLOADS, 0, torch_generator(0, "s"))
    for server in (from_sums, from_uploads):
        assert server.download()["class_ids"].tolist() == [0, 2]  # class 1: nobody's, absent
        torch.testing.assert_close(server.download()["protos"], torch.tensor([[1.0, 0.0], class_2]))


@pytest.mark.parametrize(("avg", "mean"), [("sample_weighted", 2.5), ("uniform", 2.0)])
def test_part_average_from_the_sums_by_hand(avg, mean):
    """Heads of 6 parameters, all 1 (n = 1) and all 3 (n = 3): (1 + 9) / 4 weighted, 2 uniform."""
    entry, context = make_context("lgfedavg", feature_dim=2, num_classes=2, head_avg=avg)
    uploads = {0: head_upload([1.0] * 6, 1), 5: head_upload([3.0] * 6, 3)}
    sums = _summed(entry, context, uploads)
    torch.testing.assert_close(sums["weight"], torch.tensor([4.0 if avg == "sample_weighted" else 2.0],
                                                            dtype=torch.float64))
    from_sums, from_uploads = entry.server(context), entry.server(context)
    from_sums.update_from_sums(sums, 2, 0, torch_generator(0, "s"))
    from_uploads.update(uploads, 0, torch_generator(0, "s"))
    torch.testing.assert_close(from_sums.download()["head"], torch.full((1, 6), mean))
    torch.testing.assert_close(from_uploads.download()["head"], torch.full((1, 6), mean))
