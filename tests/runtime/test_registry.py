"""The one registry type (htfl_dist.registry): its name rule at registration and look-up, a
duplicate refused in one line naming both places, the one unknown-name line, a stable order; and
that every kind sits on it with every shipped name and config resolving as it did."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from htfl_dist.config import PLUGIN_HINT, load_config
from htfl_dist.errors import ConfigError
from htfl_dist.registry import Registry
from tests.conftest import REPO
from tests.runtime.test_layering import _graph


def _line() -> int:
    """The line after the caller's: where the registration written under it happens."""
    return sys._getframe(1).f_lineno + 1


def test_a_name_is_found_in_any_case_and_listed_as_registered():
    kinds: Registry[int] = Registry("widget", "model.widget")
    kinds.add("MyWidget", 1)
    kinds.add("plain", 2)
    assert kinds.get("MyWidget") == kinds.get("mywidget") == kinds.get("MYWIDGET") == 1
    assert kinds.spelling("mywidget") == "MyWidget" and "mYwIdGeT" in kinds
    assert kinds.names() == ["MyWidget", "plain"] and list(kinds) == ["MyWidget", "plain"] and len(kinds) == 2
    assert kinds.find("other") is None and kinds.spelling("other") is None and 3 not in kinds


def test_a_duplicate_is_one_line_naming_both_places_and_the_first_stands():
    kinds: Registry[int] = Registry("widget")
    first = _line()
    kinds.add("Gear", 1)
    with pytest.raises(ValueError) as info:
        kinds.add("GEAR", 2)
    assert str(info.value) == (f"widget 'GEAR' is already registered (as 'Gear') by {__name__}, line {first}; "
                               f"{__name__}, line {first + 2} registers it again")
    with pytest.raises(ValueError) as again:
        kinds.add("Gear", 3, source="a plugin")
    assert str(again.value) == (f"widget 'Gear' is already registered by {__name__}, line {first}; "
                                "a plugin registers it again")
    assert kinds.get("gear") == 1 and kinds.names() == ["Gear"]


@pytest.mark.parametrize("name", ["", " gear", "gear\n", None])
def test_a_name_that_no_config_could_write_is_refused(name):
    with pytest.raises(ValueError, match="widget name must be a non-empty string without surrounding blanks"):
        Registry("widget").add(name, 1)


def test_the_unknown_name_line_lists_the_names_and_how_a_plugin_adds_one():
    kinds: Registry[int] = Registry("widget", "model.widget", order=str.casefold)
    kinds.add("zeta", 1)
    kinds.add("Alpha", 2)
    with pytest.raises(ConfigError) as info:
        kinds.get("beta")
    assert str(info.value) == f"config key 'model.widget' is 'beta'; registered: Alpha, zeta ({PLUGIN_HINT})"
    assert str(Registry("widget").unknown("x")) == f"config key 'widget' is 'x'; registered: none ({PLUGIN_HINT})"
    assert str(kinds.unknown("x", "algo.widget")).startswith("config key 'algo.widget' is 'x'; registered: Alpha")


def test_a_copy_does_not_see_later_registrations_nor_the_original_the_copys():
    kinds: Registry[int] = Registry("widget")
    kinds.add("a", 1)
    twin = kinds.copy()
    twin.add("b", 2)
    kinds.add("c", 3)
    assert kinds.names() == ["a", "c"] and twin.names() == ["a", "b"]


def test_registration_code_is_not_a_source_the_caller_is(monkeypatch):
    """A domain suite registers its dataset from ``domains``: a duplicate names the suite's own
    caller (here this test), not the registration code in between."""
    from htfl_dist.data.sources import domains, registry
    from htfl_dist.data.sources.digit5 import SUITE

    monkeypatch.setattr(registry, "_DATASETS", registry._DATASETS.copy())
    monkeypatch.setattr(domains, "_SUITES", domains._SUITES.copy())
    monkeypatch.setattr(domains._SUITES, "_entries", {})  # the suite is new, its dataset is not
    with pytest.raises(ValueError) as info:
        line = _line()
        domains.register_suite(SUITE)
    assert str(info.value) == ("dataset 'digit5' is already registered by htfl_dist.data.sources.digit5, line "
                               f"{_registered_line('digit5.py', 'register_suite(SUITE)')}; {__name__}, line {line} "
                               "registers it again")


def _registered_line(file: str, text: str) -> int:
    lines = (REPO / "htfl_dist" / "data" / "sources" / file).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if line.startswith(text))


def test_every_kind_sits_on_the_one_registry():
    from htfl_dist.algorithms import registry as algorithms
    from htfl_dist.data.sources import domains
    from htfl_dist.data.sources import registry as datasets
    from htfl_dist.generators import registry as generators
    from htfl_dist.models import registry as models

    heads = importlib.import_module("htfl_dist.models.heads")  # the package's heads() hides the module
    kinds = [algorithms._REGISTRY, models._ARCHITECTURES, heads._HEADS, models._MODEL_GROUPS,
             datasets._DATASETS, domains._SUITES, generators._REGISTRY]
    assert [kind.kind for kind in kinds] == ["algorithm", "architecture", "head", "model group", "dataset",
                                             "domain suite", "generator"]
    assert all(isinstance(kind, Registry) and len(kind) > 0 for kind in kinds)


def test_every_shipped_config_names_its_entries_as_registered():
    """The name rule changed no shipped look-up: each config's names are the registered spellings."""
    from htfl_dist.algorithms import get_algorithm
    from htfl_dist.data.sources import dataset_source
    from htfl_dist.generators.registry import get_generator
    from htfl_dist.models import model_groups, resolve_group

    files = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(files) > 40
    for file in files:
        config = load_config(str(file), [])
        assert get_algorithm(config.algorithm).name == config.algorithm, file
        assert dataset_source(config.data.dataset).name == config.data.dataset, file
        assert get_generator(config.generator.name).name == config.generator.name, file
        group = config.model.group
        assert resolve_group(group) == model_groups().get(group, tuple(group.split(","))), file


def test_a_group_and_an_architecture_of_one_key_are_told_apart_by_their_spelling():
    from htfl_dist.models import resolve_group

    assert resolve_group("HtCNN8") == tuple(f"htcnn{i}" for i in range(1, 9))  # the group
    assert resolve_group("htcnn8") == ("htcnn8",)  # the architecture, a homogeneous group
    assert resolve_group("HTCNN1,ResNet18:FC512") == ("htcnn1", "resnet18:fc512")  # written as registered
    with pytest.raises(ConfigError) as info:
        resolve_group("HTCNN8")
    assert str(info.value) == ("model group 'HTCNN8' is ambiguous: the model group 'HtCNN8' or the architecture "
                               "'htcnn8'; write the one you mean as it is spelled there")


def test_the_registry_sits_low_and_loads_no_torch():
    edges, witnesses = _graph()
    assert edges["registry"] <= {"config", "errors"}, {b: sorted(witnesses[("registry", b)]) for b in edges["registry"]}
    loaded = subprocess.run([sys.executable, "-c", "import sys, htfl_dist.registry; print('torch' in sys.modules)"],
                            cwd=REPO, capture_output=True, text=True, check=True)
    assert loaded.stdout.split() == ["False"]
