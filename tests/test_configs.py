"""Every shipped config must load as a user would run it: a typo in configs/ is a user-facing bug."""
from __future__ import annotations

import pytest

from conftest import REPO
from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.config import load_config
from htfl_dist.models import architecture_for_client, build_model

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_are_shipped():
    assert len(CONFIGS) >= 10


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_and_names_registered_things(path):
    config = load_config(path)  # schema and range checks
    parse_options(get_algorithm(config.algorithm), config.algo)  # the algorithm's own options
    members = {architecture_for_client(config.model.group, i) for i in range(config.num_clients)}
    assert members, path


def test_heterogeneous_classifier_configs_give_four_heads():
    """Table 2's groups: the HtC4 configs really hand out four different heads."""
    for name in ("cifar100_res34htc4_fedtgp_dirichlet", "cifar100_htfe8htc4_fedtgp_dirichlet"):
        config = load_config(REPO / "configs" / f"{name}.yaml")
        heads = {architecture_for_client(config.model.group, i).partition(":")[2] for i in range(config.num_clients)}
        assert heads == {"fc", "fc512", "fc256", "fc128"}, name
    model = build_model("resnet34:fc128", num_classes=100)
    assert model.head[0].out_features == 128 and model.head[-1].out_features == 100
