"""Every shipped config must load as a user would run it: a typo in configs/ is a user-facing bug."""
from __future__ import annotations

import dataclasses
import re

import pytest

from conftest import REPO
from htfl_dist.algorithms import get_algorithm, parse_options
from htfl_dist.config import experiment_differences, load_config
from htfl_dist.errors import ConfigError
from htfl_dist.models import architecture_for_client, build_model
from htfl_dist.resolution import algorithm_options, resolved_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_are_shipped():
    assert len(CONFIGS) >= 10


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_and_names_registered_things(path):
    config = resolved_config(str(path), [])  # schema, range checks, registered names, the algorithm's options
    assert isinstance(algorithm_options(config), get_algorithm(config.algorithm).options)
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
# say why). FedOC's table runs the authors' code with the paper's λ_c = 100 (Table 6's cell for it
# is the one next to Table 1's number; their scripts' 10 gives 57.35).
REFERENCE_OPTIONS = {
    "fedproto": {"client_reg": "htfllib", "proto_from": "during_training", "reg_weight": 10.0},
    "fedtgp": {"client_reg": "htfllib", "proto_from": "pre_update", "reg_weight": 10.0},
    "feddistill": {"compat": "reference", "distill_loss": "mse"},
    "fedgen": {"compat": "reference", "persist_generator": False},
    "fml": {"compat": "reference", "kd": "htfllib"},
    "fedkd": {"compat": "reference", "svd_rank": "htfllib", "compress": "weights"},
    "lgfedavg": {"compat": "reference"},
    "fedgh": {"compat": "reference"},
    "fedsa": {"compat": "reference", "reg_distance": "mse", "reg_weight": 10.0},
    "fedoc": {"compat": "reference", "reg_weight": 100.0, "inter_norm": "other_classes", "first_round": "ce_only"},
    "fedktl": {"compat": "reference", "unit_prototypes": True},
}
PAPER_TABLE_HEADERS = [p for p in CONFIGS if "No paper table claims this file" not in p.read_text()
                       and p.stem != "smoke"]
SINGLE_CLIENT = "cifar100_cnn_fedktl_single_client"  # Table 9: one client, its own k-shot split


def _header(path) -> str:
    return path.read_text().split("\nalgorithm:")[0]


NO_TABLE = "# No paper table claims this file: "
NO_TABLE_REASONS = ("the algorithm keeps its paper defaults.",
                    "it sets up HtFLlib's benchmark case for a side-by-side run.")
"""Why a config claims no table, in one of these words; the test below holds each to what it says."""


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_claims_a_paper_table_or_says_why_none_does(path):
    """A config either claims a paper table (its header names the table, and the tests below hold
    it to the table's rules) or gives a known reason why none does, which holds: it keeps its
    algorithm's paper defaults, or it reads HtFLlib's own split (data.partition=pfllib) with the
    reference code's options. So a config that claims a table cannot leave the table checks by
    carrying the sentence, and no count of files changes when a config is added."""
    if path.stem == "smoke":
        return
    header = _header(path)
    reasons = [line[len(NO_TABLE):] for line in header.splitlines() if line.startswith(NO_TABLE)]
    if path in PAPER_TABLE_HEADERS:
        assert not reasons and "Table" in header, path.stem
        return
    assert len(reasons) == 1 and reasons[0] in NO_TABLE_REASONS, f"{path.stem}: {reasons}"
    config = load_config(path)
    entry = get_algorithm(config.algorithm)
    options = dataclasses.asdict(parse_options(entry, config.algo))
    if reasons[0] == NO_TABLE_REASONS[0]:
        assert options == dataclasses.asdict(parse_options(entry, {})), path.stem
    else:
        assert config.data.partition == "pfllib", path.stem
        assert all(options[key] == value for key, value in REFERENCE_OPTIONS[config.algorithm].items()), path.stem


DEPARTURES = "# Departs from the paper's text:"
DEPARTURE_ITEM = re.compile(r"^# - ([a-z_]+)\.([a-z_]+)=([^:\s]+): \S")
NOT_DEPARTURES = {
    ("feddistill", "missing_rows"): "under distill_loss=mse a row aiming at its own logits adds 0, as a masked row",
    ("fedgen", "hidden_dim"): "written out: 512 = K, the default",
    ("fedgen", "generator_optimizer"): "no generator is trained under persist_generator=false",
}


def listed_departures(header: str) -> list[tuple[str, str, str]]:
    """The (section, key, value) items under the header's one departures heading; [] for 'nothing'."""
    lines = header.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(DEPARTURES)]
    assert len(starts) == 1, "one departures heading"
    rest = lines[starts[0]][len(DEPARTURES):].strip()
    items = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("#   ") and items:
            continue  # an item's continuation
        match = DEPARTURE_ITEM.match(line)
        if not match:
            break
        items.append(match.groups())
    assert (rest.startswith("nothing") and not items) or (not rest and items), rest
    return items


def _written_as(value, text: str) -> bool:
    if isinstance(value, bool):
        return text == str(value).lower()
    if isinstance(value, (int, float)):
        return float(text) == value
    return str(value) == text


@pytest.mark.parametrize("path", PAPER_TABLE_HEADERS, ids=[p.stem for p in PAPER_TABLE_HEADERS])
def test_paper_table_headers_state_the_rule_and_list_each_departure_from_the_paper(path):
    """Each option the list names exists and is what the config runs; every algorithm option the
    config runs away from the algorithm's paper default is in the list (or is no departure in effect)."""
    header = _header(path)
    assert 'docs/algorithms.md, "Paper-table configs"' in header and "runs what" in header
    config = load_config(path)
    entry = get_algorithm(config.algorithm)
    options = algorithm_options(config)
    fields = {f.name for f in dataclasses.fields(options)}
    listed = set()
    for section, key, text in listed_departures(header):
        if section == "algo":
            assert key in fields, f"{path.stem}: no option algo.{key}"
            value = getattr(options, key)
        else:
            assert hasattr(getattr(config, section), key), f"{path.stem}: no config key {section}.{key}"
            value = getattr(getattr(config, section), key)
        assert _written_as(value, text), f"{path.stem}: {section}.{key} is {value!r}, the header says {text}"
        listed.add(key)
    paper = dataclasses.asdict(parse_options(entry, {}))
    unlisted = {key for key, value in dataclasses.asdict(options).items()
                if value != paper[key] and key != "compat" and (config.algorithm, key) not in NOT_DEPARTURES}
    assert unlisted <= listed, f"{path.stem}: departures not listed: {sorted(unlisted - listed)}"


def test_a_header_without_its_departures_list_or_with_a_wrong_option_is_caught():
    header = "# Departs from the paper's text:\n# - algo.reg_weight=10: λ = 10\n#   (scripts)\n# Client batching"
    assert listed_departures(header) == [("algo", "reg_weight", "10")]
    assert listed_departures("# Departs from the paper's text: nothing; the same.\n# other") == []
    with pytest.raises(AssertionError):
        listed_departures("# no heading at all")
    with pytest.raises(AssertionError):
        listed_departures("# Departs from the paper's text:\n# Client batching")  # heading, no items


@pytest.mark.parametrize("path", PAPER_TABLE_HEADERS, ids=[p.stem for p in PAPER_TABLE_HEADERS])
def test_paper_table_configs_run_what_produced_the_table(path):
    """PFLlib's split drawn once with seed 1, its guard for batch 10, and the reference code's options,
    batching and initial weights (Table 9's single client: its own k-shot subsample, not a split)."""
    config = load_config(path)
    if path.stem != SINGLE_CLIENT:
        assert (config.data.partition_rules, config.data.partition_seed) == ("pfllib", 1)
    if config.train.batch_size != 10:
        assert config.data.min_samples_per_client == 40  # PFLlib's generator sized its guard for batch 10
    options = algorithm_options(config)
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
