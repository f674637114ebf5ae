"""The experiment identity is declared at the fields (``config.rules.Identity``) and walked by
``config.identity.section_view``: each rule on a small dataclass worked by hand, then on the real
Config (a key added later, plumbing, a location, the conditional rounds rule) and on an
algorithm's options (a renamed option and a renamed value keep the hash)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from htfl_dist.config import Config, experiment_hash, section_view
from htfl_dist.config.rules import ADDED_LATER, LOCATION, PLUMBING, Identity, declared


@dataclass
class Inner:
    size: int = 3
    newer: str = declared("old", identity=ADDED_LATER)


@dataclass
class Outer:
    kept: int = 1
    where: str = declared("here", identity=PLUMBING)
    files: str | None = declared(None, identity=LOCATION)
    renamed: float = declared(0.5, identity=Identity(hashed_as="old_name"))
    mode: str = declared("reference", identity=Identity(hashed_values=(("reference", "htfllib"),)))
    inner: Inner = declared(default_factory=Inner, identity=Identity(omit_when_default=True))
    switch: dict = field(default_factory=lambda: {"enabled": False, "level": 2})


def test_each_rule_on_a_small_section() -> None:
    values = dataclasses.asdict(Outer(files="/data/x"))
    assert section_view(Outer, values) == {
        "kept": 1,  # no rule: as it is
        "files": True,  # a location: only that it is set
        "old_name": 0.5,  # renamed: under the name runs were hashed with
        "mode": "htfllib",  # a renamed value: as runs were hashed
        "switch": {"enabled": False, "level": 2},
    }  # where (plumbing) and inner (at its default, after its own rules) are gone


def test_added_later_counts_only_away_from_its_default() -> None:
    at_default = dataclasses.asdict(Outer(inner=Inner(newer="old")))
    moved = dataclasses.asdict(Outer(inner=Inner(newer="new")))
    assert "inner" not in section_view(Outer, at_default)
    assert section_view(Outer, moved)["inner"] == {"size": 3, "newer": "new"}
    assert section_view(Outer, dataclasses.asdict(Outer(inner=Inner(size=4))))["inner"] == {"size": 4}


def test_missing_keys_of_an_older_manifest_are_tolerated() -> None:
    assert section_view(Outer, {"kept": 2, "inner": {"size": 3}}) == {"kept": 2}


def test_the_view_of_a_view_is_the_view() -> None:
    """Manifests store views and the checkpoint comparison walks them again."""
    once = section_view(Outer, dataclasses.asdict(Outer(files="f", inner=Inner(newer="x"))))
    assert section_view(Outer, once) == once


def test_config_plumbing_changes_nothing_and_a_later_key_at_its_default_neither() -> None:
    base = Config(rounds=5).config_hash()
    assert Config(rounds=50, eval_every=3, checkpoint_every=2).config_hash() == base
    moved_data = Config(rounds=5)
    moved_data.data.root, moved_data.data.cache_dir = "elsewhere", "cache"
    assert moved_data.config_hash() == base
    assert "few_shot" not in Config().experiment()["data"]
    shots = Config()
    shots.data.few_shot = 5
    assert shots.experiment()["data"]["few_shot"] == 5 and shots.config_hash() != base


def test_rounds_count_under_the_cosine_schedule_only() -> None:
    cosine = Config(rounds=5)
    cosine.train.lr_schedule = "cosine"
    longer = Config(rounds=6)
    longer.train.lr_schedule = "cosine"
    assert cosine.experiment()["rounds"] == 5 and cosine.config_hash() != longer.config_hash()
    assert "rounds" not in Config(rounds=5).experiment()


def test_pretrained_is_hashed_as_used_and_sections_off_are_left_out() -> None:
    used = Config()
    used.model.pretrained = "/weights/a"
    elsewhere = Config()
    elsewhere.model.pretrained = "/weights/b"
    assert used.experiment()["model"]["pretrained"] is True and used.config_hash() == elsewhere.config_hash()
    view = Config().experiment()
    assert not {"privacy", "participation", "generator", "eval", "runtime", "output", "stop"} & set(view)
    private = Config()
    private.privacy.enabled = True
    assert private.experiment()["privacy"]["enabled"] is True


def test_every_config_field_is_hashed_unless_declared_otherwise() -> None:
    """A field added without a declaration enters the hash of every config (and the pinned hashes
    in test_config_identity.py fail): the walker keeps what it is not told to drop."""
    @dataclass
    class Grown(Config):
        brand_new: int = 7
    assert Grown().experiment()["brand_new"] == 7
    assert experiment_hash(Grown().experiment()) != Config().config_hash()
