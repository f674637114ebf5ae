"""Every shipped config must load as a user would run it: a typo in configs/ is a user-facing bug."""
from __future__ import annotations

import pytest

from conftest import REPO
from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.config import experiment_differences, load_config
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
        assert heads == {"fc_relu", "fc512_relu", "fc256_relu", "fc128_relu"}, name  # HtFLlib's, as the table
    model = build_model("resnet34:fc128", num_classes=100)
    assert model.head[0].out_features == 128 and model.head[-1].out_features == 100


# What produced each paper table, per algorithm: the reference code's options (the configs' comments
# say why). FedOC's table matches its paper value λ_c = 100; FedKTL's configs set compat themselves.
REFERENCE_OPTIONS = {
    "fedproto": {"client_reg": "htfllib", "proto_from": "during_training", "reg_weight": 10.0},
    "fedtgp": {"client_reg": "htfllib", "proto_from": "pre_update", "reg_weight": 10.0},
    "feddistill": {"compat": "htfllib", "distill_loss": "mse"},
    "fedgen": {"compat": "htfllib", "persist_generator": False},
    "fml": {"compat": "htfllib", "kd": "htfllib"},
    "fedkd": {"compat": "htfllib", "svd_rank": "htfllib", "compress": "weights"},
    "lgfedavg": {"compat": "htfllib"},
    "fedgh": {"compat": "htfllib"},
    "fedsa": {"compat": "htfllib", "reg_distance": "mse", "reg_weight": 10.0},
    "fedoc": {"compat": "paper", "reg_weight": 100.0},
    "fedktl": {"compat": "htfllib"},
}
TABLE_CONFIGS = [p for p in CONFIGS if "No paper table claims this file" not in p.read_text()
                 and p.stem not in ("smoke", "cifar100_cnn_fedktl_single_client")]


def test_every_config_says_whether_it_claims_a_paper_table():
    assert len(TABLE_CONFIGS) == 34  # 46 files: 10 FMNIST ones without a table row, smoke, single-client
    for path in TABLE_CONFIGS:
        assert "Table" in path.read_text().split("\nalgorithm:")[0], path.stem


@pytest.mark.parametrize("path", TABLE_CONFIGS, ids=[p.stem for p in TABLE_CONFIGS])
def test_paper_table_configs_run_what_produced_the_table(path):
    """PFLlib's split drawn once with seed 1, its guard for batch 10, and the reference code's options,
    batching and initial weights."""
    config = load_config(path)
    assert (config.data.partition_rules, config.data.partition_seed) == ("pfllib", 1)
    if config.train.batch_size != 10:
        assert config.data.min_samples_per_client == 40  # PFLlib's generator sized its guard for batch 10
    options = parse_options(get_algorithm(config.algorithm), config.algo)
    for key, value in REFERENCE_OPTIONS[config.algorithm].items():
        assert getattr(options, key) == value, (path.stem, key)
    if "HtC4" in config.model.group:
        assert config.model.group.endswith("-htfllib")
    # the reference clients' DataLoader(shuffle=False, drop_last=True) and torch.manual_seed before each model
    assert (config.train.batch_order, config.train.last_batch, config.model.init) == ("fixed", "drop", "htfllib")


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
    under the legacy rules (the only ones then) the experiment (hence the hash that checkpoints are
    checked against) is the one older versions wrote. 80828acf6e89147d is configs/smoke.yaml's hash
    at aa55bef."""
    legacy = ["data.partition_rules=legacy"]
    assert load_config(REPO / "configs" / "smoke.yaml", legacy).config_hash() == "80828acf6e89147d"
    assert load_config(REPO / "configs" / "smoke.yaml", []).config_hash() != "80828acf6e89147d"  # pfllib now
    # the legacy guard unset means 10: writing it out is the same experiment
    assert (load_config(None, [*legacy, "data.min_samples_per_client=10"]).config_hash()
            == load_config(None, legacy).config_hash())
    # but not under the pfllib rules, whose own guard comes from the batch size
    assert (load_config(None, ["data.min_samples_per_client=10"]).config_hash()
            != load_config(None, []).config_hash())


def test_a_run_from_before_the_pfllib_default_is_told_which_rules_it_used():
    """A checkpoint's experiment written before data.partition_rules existed has no such key: the
    comparison on resume spells it out as legacy, so the user reads what to pass."""
    old = load_config(None, ["data.partition_rules=legacy"]).experiment()
    assert "partition_rules" not in old["data"]
    assert experiment_differences(old, load_config(None, []).experiment()) == [
        "data.min_samples_per_client: 10 -> None", "data.partition_rules: 'legacy' -> 'pfllib'"]
    assert experiment_differences(old, load_config(None, ["data.partition_rules=legacy"]).experiment()) == []


def test_reading_a_pfllib_directory_needs_the_directory():
    with pytest.raises(ConfigError, match=r"^data.partition=pfllib needs data.pfllib_dir=DIR"):
        load_config(None, ["data.partition=pfllib"])
