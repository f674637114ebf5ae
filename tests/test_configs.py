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


@pytest.mark.parametrize(("override", "message"), [
    ("data.beta=0", "config key 'data.beta' must be > 0 (Dirichlet concentration), got 0.0"),
    ("data.train_ratio=1", "config key 'data.train_ratio' must be in (0, 1), got 1.0"),
    ("data.subsample=0", "config key 'data.subsample' must be in (0, 1], got 0.0"),
    ("rounds=0", "config key 'rounds' must be >= 1, got 0"),
    ("checkpoint_every=-1", "config key 'checkpoint_every' must be >= 0 (0 = never), got -1"),
    ("data.partition_seed=-1", "config key 'data.partition_seed' must be >= 0 (or null: the run's seed), got -1"),
])
def test_bounds_at_their_edges_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == message


@pytest.mark.parametrize("override", ["join_ratio=1", "checkpoint_every=0", "data.subsample=1", "data.partition_seed=0",
                                      "runtime.threads=0", "runtime.heartbeat_timeout_s=0"])
def test_the_included_edges_are_accepted(override):
    load_config(None, [override])


def test_null_only_where_a_bound_allows_it():
    from htfl_dist.config import Bound

    assert Bound(at_least=0, optional=True).holds(None)
    assert not Bound(at_least=0).holds(None)


def test_configs_from_before_the_partition_options_keep_their_hash():
    """data.partition_rules, data.partition_seed and an optional min_samples_per_client came later:
    at their defaults the experiment (hence the hash that checkpoints are checked against) is
    the one older versions wrote. 80828acf6e89147d is configs/smoke.yaml's hash at aa55bef."""
    config = load_config(REPO / "configs" / "smoke.yaml", [])
    assert config.config_hash() == "80828acf6e89147d"
    # the legacy guard unset means 10: writing it out is the same experiment
    assert load_config(None, ["data.min_samples_per_client=10"]).config_hash() == load_config(None, []).config_hash()


def test_reading_a_pfllib_directory_needs_the_directory():
    with pytest.raises(ConfigError, match=r"^data.partition=pfllib needs data.pfllib_dir=DIR"):
        load_config(None, ["data.partition=pfllib"])
