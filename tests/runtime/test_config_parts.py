"""What the config package's parts (rules, schema, loading, identity) and the resolution step above
the registries guarantee together: the chosen algorithm's options are checked when a config is
resolved and read back typed, every range (the algorithms' options included) is declared on its
field and worded by one helper, and the config parts import without the algorithms, the runtime
or torch (the algorithms are reached only by ``htfl_dist.resolution``)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest

from conftest import REPO, SMOKE
from htfl_dist.algorithms import algorithm_names, get_algorithm
from htfl_dist.algorithms.fedktl import FedKTLOptions
from htfl_dist.algorithms.fedoc import FedOCOptions
from htfl_dist.algorithms.fedtgp import FedTGPOptions
from htfl_dist.config import PLUGIN_HINT, config_from_dict, load_config
from htfl_dist.errors import ConfigError
from htfl_dist.main import main
from htfl_dist.resolution import algorithm_options, resolve, resolved_config


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        resolved_config(str(SMOKE), overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ algo.* is checked at load time

@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm=fedsa", "algo.ema_decay=1.5"], "config key 'algo.ema_decay' must be in [0, 1], got 1.5"),
    (["algorithm=fedsa", "algo.mcl_weight=-1"], "config key 'algo.mcl_weight' must be >= 0, got -1.0"),
    (["algorithm=fedsa", "algo.reg_weight=-0.5"], "config key 'algo.reg_weight' must be >= 0, got -0.5"),
    (["algorithm=fedoc", "algo.server_epochs=0"], "config key 'algo.server_epochs' must be >= 1, got 0"),
    (["algorithm=fedoc", "algo.server_lr=0"], "config key 'algo.server_lr' must be > 0, got 0.0"),
    (["algorithm=fedoc", "algo.hidden_dim=0"], "config key 'algo.hidden_dim' must be >= 1, got 0"),
    (["algorithm=fedoc", "algo.server_batch_size=0"], "config key 'algo.server_batch_size' must be >= 1, got 0"),
    (["algorithm=fedoc", "algo.inter_weight=-2"], "config key 'algo.inter_weight' must be >= 0, got -2.0"),
    (["algorithm=fedktl", "algo.arcface_scale=0"], "config key 'algo.arcface_scale' must be > 0, got 0.0"),
    (["algorithm=fedktl", "algo.mu=-1"], "config key 'algo.mu' must be >= 0, got -1.0"),
    (["algorithm=fedktl", "algo.server_batch_size=0"], "config key 'algo.server_batch_size' must be >= 1, got 0"),
    (["algorithm=fedktl", "algo.pairs_per_step=0"], "config key 'algo.pairs_per_step' must be >= 1, got 0"),
    (["algorithm=fedtgp", "algo.proto_from=later"],
     "config key 'algo.proto_from' is 'later'; allowed: post_update, pre_update, during_training"),
    (["algorithm=fedtgp", "algo.margin=fixed"],
     "algo.margin=fixed needs algo.fixed_margin=VALUE (>= 0); the paper gives no default"),
])
def test_a_bad_algorithm_option_is_refused_by_load_config_in_one_line(overrides, message):
    assert _refusal(overrides) == message


def test_an_unknown_option_or_algorithm_is_refused_by_load_config():
    assert _refusal(["algo.tau=1"]).startswith(  # smoke runs fedproto, which has no tau
        "unknown config key 'algo.tau'; allowed keys here: client_reg, reg_weight, proto_from, proto_samples, weighted")
    assert _refusal(["algorithm=fedfoo"]).startswith("config key 'algorithm' is 'fedfoo'; registered: ")
    with pytest.raises(ConfigError, match=r"^config key 'algo.ema_decay' must be in \[0, 1\], got 2.0$"):
        resolve(config_from_dict({"algorithm": "fedsa", "algo": {"ema_decay": 2.0}}))


@pytest.mark.parametrize("override, start", [
    ("algorithm=fedfoo", "config key 'algorithm' is 'fedfoo'; registered: feddistill, "),
    ("data.dataset=mnist", "config key 'data.dataset' is 'mnist'; registered: fmnist, cifar10, "),
    ("model.group=HtFE7", "unknown model group 'HtFE7'; allowed: HeteroCNN-a-e, HeteroResNet18-a-e, HtCNN8, "),
    ("generator.name=stylegan9", "config key 'generator.name' is 'stylegan9'; registered: dcgan_faces, "),
])
def test_every_registry_named_key_is_resolved_at_load_with_the_plugin_hint(override, start):
    """The four keys a registry holds are all refused by the resolution step, before anything
    starts, each line saying how a plugin adds a name; loading alone (no registry) accepts them."""
    message = _refusal([override])
    assert message.startswith(start) and message.endswith(f"{PLUGIN_HINT})"), message
    assert load_config(SMOKE, [override]) is not None


def test_the_plugins_key_takes_a_name_or_a_list_of_names():
    assert load_config(SMOKE, ["plugins=[' my_plugin ', other.mod]"]).plugins == ["my_plugin", "other.mod"]
    assert load_config(SMOKE, ["plugins=one_module"]).plugins == ["one_module"]
    assert load_config(SMOKE, []).plugins == []
    for bad in ("plugins=[1, 2]", "plugins={a: 1}", "plugins=['']"):
        with pytest.raises(ConfigError, match=r"^config key 'plugins' must be a list of names, got "):
            load_config(SMOKE, [bad])


@pytest.mark.parametrize("overrides", [
    ["algorithm=fedsa", "algo.ema_decay=0"], ["algorithm=fedsa", "algo.ema_decay=1"],
    ["algorithm=fedoc", "algo.server_epochs=1", "algo.hidden_dim=1", "algo.reg_weight=0"],
    ["algorithm=fedktl", "algo.arcface_margin=0", "algo.mu=0", "algo.pairs_per_step=1"],
    ["algorithm=fedtgp", "algo.margin=fixed", "algo.fixed_margin=0"],
])
def test_the_edges_a_range_includes_are_accepted(overrides):
    load_config(SMOKE, overrides)


def test_the_command_line_refuses_a_bad_option_with_status_2_before_writing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--config", str(SMOKE), "--out", str(out), "algorithm=fedoc", "algo.server_lr=-1"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["htfl_dist: error: config key 'algo.server_lr' must be > 0, got -1.0"]
    assert not out.exists()


# ------------------------------------------------------------------ the typed view

def test_algo_options_is_the_algorithms_dataclass_with_compat_resolved_and_algo_kept_as_written():
    config = load_config(SMOKE, ["algorithm=fedtgp", "algo.client_reg=htfllib", "algo.server_epochs=7"])
    options = algorithm_options(config)
    assert isinstance(options, FedTGPOptions)
    # the unset λ resolves to the htfllib regulariser's 10; written values are kept, typed
    assert (options.client_reg, options.reg_weight, options.server_epochs) == ("htfllib", 10.0, 7)
    assert config.algo == {"client_reg": "htfllib", "server_epochs": 7}  # stored and hashed as written


def test_algo_options_follows_algo_and_algorithm_when_they_are_replaced():
    config = load_config(SMOKE, ["algorithm=fedoc"])
    assert isinstance(algorithm_options(config), FedOCOptions) and algorithm_options(config).reg_weight == 100.0
    config.algo = {"compat": "reference"}
    assert algorithm_options(config).reg_weight == 10.0
    config.algorithm, config.algo = "fedktl", {}
    assert isinstance(algorithm_options(config), FedKTLOptions)


def test_the_typed_view_leaves_the_hash_alone():
    """Reading ``algorithm_options`` (which fills in the resolved defaults on its own object) changes
    neither ``algo`` nor the experiment hash. 80828acf6e89147d is configs/smoke.yaml's hash
    under the legacy partition rules, as older versions wrote it."""
    config = load_config(REPO / "configs" / "smoke.yaml", ["data.partition_rules=legacy"])
    before = config.config_hash()
    assert algorithm_options(config).reg_weight is not None
    assert config.config_hash() == before == "80828acf6e89147d"


@pytest.mark.parametrize(("overrides", "message"), [
    (["seed=-1"], "config key 'seed' is -1; data.partition_rules=pfllib seeds numpy's RandomState, "
                  "which takes 0..4294967295"),
    (["data.partition_seed=4294967296"], "config key 'data.partition_seed' is 4294967296; "
     "data.partition_rules=pfllib seeds numpy's RandomState, which takes 0..4294967295"),
])
def test_the_seed_of_a_pfllib_split_is_checked_at_load_naming_the_key_that_seeds_it(overrides, message):
    assert _refusal(overrides) == message


@pytest.mark.parametrize("overrides", [
    ["seed=4294967295"], ["seed=-1", "data.partition_seed=0"], ["seed=-1", "data.partition_rules=legacy"]])
def test_seeds_numpy_never_sees_are_not_limited_by_it(overrides):
    load_config(SMOKE, overrides)


# ------------------------------------------------------------------ field rules, declared once

NUMBERS_CHECKED_ACROSS_FIELDS = {("fedtgp", "fixed_margin")}
"""Read only under margin=fixed, where ``validate`` asks for it (>= 0) in one line."""
OPEN_NAMES = {"shared_model"}
"""An architecture name (ARCH or ARCH:HEAD), checked against the model registry."""


def _field_types(options: type) -> list[tuple[str, tuple]]:
    hints = typing.get_type_hints(options)
    return [(item.name, typing.get_args(hints[item.name]) or (hints[item.name],))
            for item in dataclasses.fields(options)]


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_numeric_option_declares_its_range_and_every_text_option_is_a_choice(algorithm):
    options = get_algorithm(algorithm).options
    fields = {item.name: item for item in dataclasses.fields(options)}
    for name, types in _field_types(options):
        if any(kind in (int, float) for kind in types) and (algorithm, name) not in NUMBERS_CHECKED_ACROSS_FIELDS:
            assert "bound" in fields[name].metadata, f"algo.{name} of {algorithm}: declare its range with bounded()"
        if str in types:
            assert name in OPEN_NAMES, f"algo.{name} of {algorithm}: a closed choice is a Literal[...]"


# ------------------------------------------------------------------ import direction

def test_the_parts_import_without_the_algorithms_or_the_runtime():
    probe = ("import sys, importlib\n"
             "for part in ('rules', 'identity', 'schema', 'loading', '__init__'):\n"
             "    name = 'htfl_dist.config' + ('' if part == '__init__' else '.' + part)\n"
             "    importlib.import_module(name)\n"
             "loaded = sorted(m for m in sys.modules\n"
             "                if m.startswith(('htfl_dist.algorithms', 'htfl_dist.runtime', 'torch')))\n"
             "print(loaded)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
