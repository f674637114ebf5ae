"""Loading a config: a YAML file and dotted ``key=value`` overrides, coerced to the schema's
types and checked once, every mistake one ConfigError line naming the key (exit status 2).

The YAML is read by a safe loader that refuses what would silently change or blow up a config
(a key given twice, alias bombs, deep nesting); values are coerced to each field's annotation
(``Literal`` choices, finite float32-sized numbers, int64 counts, lists of names); ``validate``
then runs the declared bounds and each section's cross-field check. Loading imports neither torch
nor any registry: the names a registry holds are resolved one step up (``htfl_dist.resolution``).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from htfl_dist.config.schema import Config, check_bounds
from htfl_dist.errors import ConfigError, clipped, shown

YAML_SWITCH = {False: "off", True: "on"}
"""YAML 1.1 (PyYAML) reads a bare ``off``/``on`` (and no/yes, false/true) as a boolean, so a choice
named ``off`` (``train.client_batching``) is taken back from the boolean it became."""


FLOAT32_MAX = 3.4028234663852886e38
"""Every number reaches the tensors as float32: a larger one is infinite there (SGD refuses an
lr of 1e308; a threshold of 1e39 compares as inf)."""
INT64_MAX = (1 << 63) - 1
"""Counts and seeds travel and are stored as int64."""


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the field's type, or raise a one-line ConfigError."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is typing.Literal:
        allowed = [str(choice) for choice in args]
        if isinstance(value, bool) and YAML_SWITCH[value] in allowed:
            value = YAML_SWITCH[value]  # YAML reads a bare off/on as a boolean
        if str(value) not in allowed or isinstance(value, (dict, list)):
            raise ConfigError(f"config key '{key}' is {shown(value)}; allowed: {', '.join(allowed)}")
        return str(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"config key '{key}' must be true or false, got {shown(value)}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be an integer, got {shown(value)}")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config key '{key}' must be an integer, got {shown(value)}") from None
        if not as_float.is_integer():
            raise ConfigError(f"config key '{key}' must be an integer, got {shown(value)}")
        if abs(as_float) > INT64_MAX:
            raise ConfigError(f"config key '{key}' must fit in 64 bits (at most {INT64_MAX}), got {shown(value)}")
        return int(as_float)
    if annotation is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config key '{key}' must be a number, got {shown(value)}") from None
        if not math.isfinite(number):  # .inf would overflow a timedelta, nan passes every comparison
            raise ConfigError(f"config key '{key}' must be a finite number, got {shown(value)}")
        if abs(number) > FLOAT32_MAX:
            raise ConfigError(f"config key '{key}' must be at most {FLOAT32_MAX:.4g} in size (the largest "
                              f"float32, which the arithmetic uses), got {shown(value)}")
        return number
    if origin is list and args == (str,):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(item, str) and item.strip() for item in items):
            raise ConfigError(f"config key '{key}' must be a list of names, got {shown(value)}")
        return [item.strip() for item in items]
    if annotation is str:
        if value is None or isinstance(value, (dict, list)):
            raise ConfigError(f"config key '{key}' must be a string, got {shown(value)}")
        return str(value)
    return value


def _comma_joined(items: list[Any], key: str) -> str:
    """A YAML list of names as one comma-separated string (the canonical form of list keys)."""
    if not items or not all(isinstance(item, str) and item.strip() and "," not in item for item in items):
        raise ConfigError(f"config key '{key}' must be a name or a non-empty list of names, got {shown(items)}")
    return ",".join(item.strip() for item in items)


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def build_section(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.')}' must be a mapping, got {shown(raw)}")
    hints = _resolved_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = clipped(f"{prefix}{key}")
        if key not in names:
            close = difflib.get_close_matches(clipped(str(key)), names, n=1)
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            raise ConfigError(
                f"unknown config key '{dotted}'; {hint}allowed keys here: {', '.join(names)}"
            )
        annotation = hints[key]
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            kwargs[key] = build_section(annotation, value or {}, f"{dotted}.")
        elif typing.get_origin(annotation) is dict:  # a registered thing's options (algo, data.options, ...)
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{dotted}' must be a mapping of options, got {shown(value)}")
            kwargs[key] = dict(value)
        elif key in getattr(cls, "LIST_KEYS", ()) and isinstance(value, list):
            kwargs[key] = _comma_joined(value, dotted)
        else:
            kwargs[key] = _coerce(value, annotation, dotted)
    return cls(**kwargs)


def checked_section(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """A registered thing's options (``algo.*``, ``data.options.*``): ``cls`` built from ``raw``
    (names, types), its declared bounds checked, then its own ``validate`` (choices that depend on
    each other, presets resolving the knobs left unset), every error one line under ``prefix``."""
    options = build_section(cls, raw, prefix)
    check_bounds(options, prefix)
    validate = getattr(options, "validate", None)
    if validate is not None:
        validate()
    return options


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{clipped(dotted)}': '{clipped(part)}' is not a section")
        node = child
    node[parts[-1]] = value


class RefusedYaml(Exception):
    """YAML that parses but is refused: a duplicated key, aliases that expand too far, nesting too
    deep. The caller says where it came from (a file, an override)."""


MAX_EXPANDED_NODES = 10_000
"""A config's node count with every alias expanded (the largest config in configs/ has about 60).
Aliases share one object when loaded, but anything that walks the value (a repr for an error
line, a deep copy, the config hash) walks the expansion: ten levels of ten aliases ("billion
laughs") are 10^10 nodes from a few hundred bytes."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (the later value would win
    silently) and documents whose alias expansion exceeds ``MAX_EXPANDED_NODES``."""

    def construct_document(self, node: yaml.Node) -> Any:
        _expanded_size(node, {}, set())
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' then a key: a deliberate override
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                seen_at = first_line.get(key)
            except TypeError:  # an unhashable key: the base class names it
                continue
            if seen_at is not None:
                raise RefusedYaml(f"key {shown(key)} appears twice in one mapping, at lines {seen_at} and {line}; "
                                  f"keep one")
            first_line[key] = line
        return super().construct_mapping(node, deep)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes under ``node`` with aliases expanded (each shared node counted once per use, by
    memo, so the walk itself stays linear); raises RefusedYaml past the bound or on a cycle."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise RefusedYaml("an alias refers to a node that contains it (a recursive structure)")
    open_nodes.add(id(node))
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, sizes, open_nodes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(key, sizes, open_nodes) + _expanded_size(value, sizes, open_nodes)
                    for key, value in node.value)
    open_nodes.discard(id(node))
    if size > MAX_EXPANDED_NODES:
        raise RefusedYaml(f"its aliases expand to more than {MAX_EXPANDED_NODES} values; write the values out")
    sizes[id(node)] = size
    return size


def load_yaml(text: str) -> Any:
    """One YAML document through ``_BoundedLoader``. Raises yaml.YAMLError (invalid YAML) or
    RefusedYaml (valid, but refused)."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader subclass
    except RecursionError:
        raise RefusedYaml("it is nested too deeply") from None


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``key=value`` strings to (key, YAML-parsed value) pairs."""
    pairs = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {shown(item)} must look like key=value, e.g. rounds=3")
        key, text = item.split("=", 1)
        try:
            value = load_yaml(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        except RefusedYaml as exc:
            raise ConfigError(f"override {clipped(key)}: {exc}") from None
        pairs.append((key.strip(), value))
    return pairs


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or defaults when ``path`` is None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {shown(str(file))} does not exist; pass --config PATH")
        try:
            loaded = load_yaml(file.read_bytes().decode("utf-8"))
        except RefusedYaml as exc:
            raise ConfigError(f"config file {shown(str(file))} is refused: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {shown(str(file))} is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                              f"at offset {exc.start}); save it as UTF-8") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {shown(str(file))} is not valid YAML{where}") from None
        if loaded is None:  # a run of every default is never what an empty file meant
            raise ConfigError(f"config file {shown(str(file))} is empty; write at least 'algorithm: NAME', "
                              f"or leave out --config to run the defaults")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {shown(str(file))} must hold a mapping of keys")
        raw = loaded
    for key, value in parse_overrides(overrides or []):
        _set_dotted(raw, key, value)
    config = build_section(Config, raw, "")
    validate(config)
    return config


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a config from a nested dict (used for resolved configs and tests)."""
    config = build_section(Config, raw, "")
    validate(config)
    return config


def validate(config: Config) -> None:
    """Checks that need neither the dataset nor a registry: every field's declared bound and each
    section's own cross-field check (and ``~`` in path keys expanded, which the shell does on a
    command line but YAML does not). Closed choices are ``Literal`` fields, checked while parsing;
    the names a registry holds (the algorithm and its options, the dataset, the model group, the
    generator) are checked by the resolution step above the registries
    (``htfl_dist.resolution``)."""
    for key in ("root", "cache_dir", "pfllib_dir"):
        value = getattr(config.data, key)
        if value:
            setattr(config.data, key, os.path.expanduser(value))
    if config.generator.path:
        config.generator.path = os.path.expanduser(config.generator.path)
    check_bounds(config)
    config.data.check()
    config.train.check()
    config.model.check()
    config.runtime.check()
    config.participation.check()
    config.check()
