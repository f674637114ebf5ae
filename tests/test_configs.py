"""Every shipped config must load as a user would run it: a typo in configs/ is a user-facing bug."""
from __future__ import annotations

import pytest

from conftest import REPO
from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.config import load_config
from htfl_dist.errors import ConfigError
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


def test_custom_group_from_a_yaml_list_or_commas(tmp_path):
    """HtCNN8 extractors with HtC4 heads on FMNIST: a custom group, as a YAML list or comma-separated;
    both spellings are the same experiment (same config hash)."""
    members = ["htcnn1:fc", "htcnn2:fc512", "htcnn3:fc256", "htcnn4:fc128"]
    as_file = tmp_path / "custom.yaml"
    as_file.write_text("model:\n  group: [" + ", ".join(members) + "]\n")
    from_list = load_config(as_file)
    from_commas = load_config(None, ["model.group=" + ",".join(members)])
    assert from_list.model.group == from_commas.model.group == ",".join(members)
    assert from_list.config_hash() == from_commas.config_hash()
    assert [architecture_for_client(from_list.model.group, i) for i in range(6)] == members + members[:2]


@pytest.mark.parametrize("group,needle", [
    ("htcnn1,foo", "unknown architecture 'foo' in model group 'htcnn1,foo'"),
    ("htcnn1,,htcnn2", "has an empty member"),
    ("htcnn1,htcnn2:fc64", "unknown head 'fc64' in 'htcnn2:fc64'"),
])
def test_bad_custom_group_is_one_line(group, needle):
    with pytest.raises(ConfigError) as info:
        architecture_for_client(load_config(None, [f"model.group={group}"]).model.group, 0)
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["[]", "[1, 2]"])
def test_model_group_list_must_hold_names(value):
    with pytest.raises(ConfigError, match="must be a name or a non-empty list of names"):
        load_config(None, [f"model.group={value}"])
