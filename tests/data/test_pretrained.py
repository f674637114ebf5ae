"""model.pretrained: per-architecture weight files loaded into clients' feature extractors (or
whole models), their one-line refusals, their identity in the config hash and the checkpoints,
and a run that starts from them. Every weight file here is written by the test itself, with
torch.save, from a real torchvision model or one of our members with recognisable values."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import REPO, SMOKE, read_metrics, run_program
from htfl_dist.config import load_config
from htfl_dist.errors import ConfigError
from htfl_dist.models import InputSpec, SplitModel, build_model, initial_client_model, load_pretrained
from htfl_dist.models import pretrained as pretrained_module
from htfl_dist.runtime.simulate import simulate

FMNIST = InputSpec.image(1, 28)


def _config(directory: Path, group: str, *overrides: str, num_clients: int = 4):
    return load_config(None, [f"model.group={group}", f"model.pretrained={directory}",
                              f"num_clients={num_clients}", *overrides])


def _member(member: str, seed: int, in_channels: int = 1, image_size: int = 28) -> SplitModel:
    torch.manual_seed(seed)
    return build_model(member, num_classes=10, feature_dim=512, in_channels=in_channels, image_size=image_size)


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def _assert_state_equal(module: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = module.state_dict()
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def _recognisable(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter a seeded draw, every BatchNorm buffer a known pattern: nothing a fresh
    model could have by chance."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("num_batches_tracked"):
            state[name] = torch.full_like(tensor, 1234)
        elif name.endswith("running_var"):
            state[name] = torch.arange(1, tensor.numel() + 1, dtype=tensor.dtype).reshape(tensor.shape) / 7
        else:
            state[name] = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
    return state


# ---------------------------------------------------------------- loading, parameter for parameter


def test_torchvision_resnet18_state_dict_loads_into_the_feature_extractor(tmp_path):
    """A state dict saved from torchvision's own resnet18 (ImageNet's 1000-way fc included) loads
    into our resnet18 member's feature extractor tensor for tensor; the fc is skipped and the head
    keeps the draw model.init made."""
    torchvision_models = pytest.importorskip("torchvision.models")
    saved = _recognisable(torchvision_models.resnet18(weights=None), seed=5)
    assert saved["fc.weight"].shape == (1000, 512)
    torch.save(saved, tmp_path / "resnet18.pt")
    model = _member("resnet18", seed=0, in_channels=3, image_size=32)
    head_before = _clone(model.head.state_dict())

    load_pretrained(model, _config(tmp_path, "resnet18"))

    _assert_state_equal(model.feature_extractor, {name: t for name, t in saved.items() if not name.startswith("fc.")})
    _assert_state_equal(model.head, head_before)


def test_htfllib_base_head_split_names_load(tmp_path):
    """HtFLlib's BaseHeadSplit state dict (base.* = torchvision's names, fc pooled away; head.*),
    as its -mfn folders' models write it once converted to a state dict: features or whole."""
    torchvision_models = pytest.importorskip("torchvision.models")
    base = {name: t for name, t in _recognisable(torchvision_models.resnet18(weights=None), seed=8).items()
            if not name.startswith("fc.")}
    head = {"weight": torch.full((10, 512), 0.25), "bias": torch.arange(10, dtype=torch.float32)}
    torch.save({**{f"base.{n}": t for n, t in base.items()}, **{f"head.{n}": t for n, t in head.items()}},
               tmp_path / "resnet18.pt")

    model = _member("resnet18", seed=0, in_channels=3, image_size=32)
    head_before = _clone(model.head.state_dict())
    load_pretrained(model, _config(tmp_path, "resnet18"))
    _assert_state_equal(model.feature_extractor, base)
    _assert_state_equal(model.head, head_before)

    model = _member("resnet18", seed=0, in_channels=3, image_size=32)
    load_pretrained(model, _config(tmp_path, "resnet18", "model.pretrained_part=whole"))
    _assert_state_equal(model.feature_extractor, base)
    _assert_state_equal(model.head, head)


def test_our_members_state_dicts_load_the_extractor_or_the_whole_model(tmp_path):
    """A whole-model state dict of one of our members (feature_extractor.*, head.*): ``features``
    loads the extractor and leaves the head; ``whole`` loads both, ``ARCH:HEAD`` from ARCH+HEAD.pt;
    and the extractor's own state dict (no prefix) loads too."""
    source = _member("htcnn2", seed=3)
    whole = _recognisable(source, seed=11)
    torch.save(whole, tmp_path / "htcnn2.pt")
    headed = _recognisable(_member("htcnn1:fc512", seed=0), seed=12)
    torch.save(headed, tmp_path / "htcnn1+fc512.pt")
    extractor_only = {name.removeprefix("feature_extractor."): t for name, t in
                      _recognisable(_member("htcnn1", seed=0), seed=13).items() if name.startswith("feature_")}
    torch.save(extractor_only, tmp_path / "htcnn1.pt")
    extractor = {name.removeprefix("feature_extractor."): t for name, t in whole.items() if name.startswith("feature_")}

    model = _member("htcnn2", seed=0)
    head_before = _clone(model.head.state_dict())
    load_pretrained(model, _config(tmp_path, "htcnn2"))
    _assert_state_equal(model.feature_extractor, extractor)
    _assert_state_equal(model.head, head_before)

    model = _member("htcnn2", seed=0)
    load_pretrained(model, _config(tmp_path, "htcnn2", "model.pretrained_part=whole"))
    _assert_state_equal(model, whole)

    model = _member("htcnn1:fc512", seed=0)
    load_pretrained(model, _config(tmp_path, "htcnn1:fc512", "model.pretrained_part=whole"))
    _assert_state_equal(model, headed)

    model = _member("htcnn1:fc512", seed=0)  # features: the head does not matter, htcnn1.pt is read
    load_pretrained(model, _config(tmp_path, "htcnn1:fc512"))
    _assert_state_equal(model.feature_extractor, extractor_only)


def test_without_model_pretrained_nothing_is_read(tmp_path):
    model = _member("htcnn1", seed=0)
    before = _clone(model.state_dict())
    load_pretrained(model, load_config(None, ["model.group=htcnn1"]))
    _assert_state_equal(model, before)


# ---------------------------------------------------------------- refusals, one line each


def _write_htcnn1(directory: Path, edit=None, name: str = "htcnn1.pt") -> None:
    state = _recognisable(_member("htcnn1", seed=0), seed=21)
    if edit is not None:
        state = edit(state)
    torch.save(state, directory / name)


def _without(name):
    return lambda state: {key: value for key, value in state.items() if key != name}


def _with(name, value):
    return lambda state: {**state, name: value}


def _nan_in(name):
    def edit(state):
        state[name] = state[name].clone()
        state[name][0] = float("nan")
        return state
    return edit


def _reshaped(name):
    return lambda state: {**state, name: state[name][:, :-1]}


REFUSALS = {
    "missing tensor": (_without("feature_extractor.0.bias"), "lacks tensor 'feature_extractor.0.bias'"),
    "unexpected tensor": (_with("feature_extractor.9.weight", torch.ones(2)),
                          "unexpected tensor 'feature_extractor.9.weight'"),
    "unexpected outside the model": (_with("optimizer.lr", torch.ones(1)), "unexpected tensor 'optimizer.lr'"),
    "shape": (_reshaped("feature_extractor.4.weight"),
              "tensor 'feature_extractor.4.weight' has shape (512, 4607) but htcnn1's has (512, 4608)"),
    "not finite": (_nan_in("feature_extractor.4.bias"), "tensor 'feature_extractor.4.bias' holds values that are "
                                                        "not finite"),
    "non-tensor entry": (_with("epoch", 3), "entry 'epoch' is a int, not a tensor"),
    "nested dict": (lambda state: {"state_dict": state}, "entry 'state_dict' is a dict, not a tensor"),
    "not a mapping": (lambda state: list(state.values()), "holds a list, not a state dict"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_bad_weight_file_is_refused_in_one_line_naming_file_and_tensor(tmp_path, case):
    edit, expected = REFUSALS[case]
    _write_htcnn1(tmp_path, edit)
    model = _member("htcnn1", seed=0)
    before = _clone(model.state_dict())
    with pytest.raises(ConfigError) as caught:
        load_pretrained(model, _config(tmp_path, "htcnn1"))
    message = str(caught.value)
    assert "\n" not in message
    assert str(tmp_path / "htcnn1.pt") in message
    assert expected in message
    _assert_state_equal(model, before)  # nothing copied before every tensor was checked


def test_a_missing_file_for_a_member_in_use_is_refused(tmp_path):
    """Every member the run's clients get needs its file, named before any client is loaded;
    a member no client gets (num_clients below the group's size) needs none."""
    _write_htcnn1(tmp_path)
    model = _member("htcnn1", seed=0)
    with pytest.raises(ConfigError, match=r"^model.pretrained: no weights for htcnn3 in .*: expected htcnn3\.pt "):
        load_pretrained(model, _config(tmp_path, "htcnn1,htcnn3", num_clients=2))
    load_pretrained(model, _config(tmp_path, "htcnn1,htcnn3", num_clients=1))
    (tmp_path / "htcnn3.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"htcnn3\.safetensors is there, but this install reads torch\.save files"):
        load_pretrained(model, _config(tmp_path, "htcnn1,htcnn3", num_clients=2))
    with pytest.raises(ConfigError, match="is not a directory"):
        load_pretrained(model, _config(tmp_path / "nowhere", "htcnn1"))


def test_whole_needs_the_whole_models_names_and_the_head_specific_file(tmp_path):
    extractor = {name.removeprefix("feature_extractor."): t for name, t in
                 _recognisable(_member("htcnn1", seed=0), seed=1).items() if name.startswith("feature_")}
    torch.save(extractor, tmp_path / "htcnn1.pt")
    with pytest.raises(ConfigError, match=r"lacks tensor 'feature_extractor.0.weight' of htcnn1's model; "
                                          r"model.pretrained_part=whole needs the whole model's state dict"):
        load_pretrained(_member("htcnn1", seed=0), _config(tmp_path, "htcnn1", "model.pretrained_part=whole"))
    with pytest.raises(ConfigError, match=r"no weights for htcnn1:fc512 in .*: expected htcnn1\+fc512\.pt"):
        load_pretrained(_member("htcnn1:fc512", seed=0),
                        _config(tmp_path, "htcnn1:fc512", "model.pretrained_part=whole"))


def test_a_pickled_module_is_refused_by_weights_only(tmp_path):
    """HtFLlib's -mfn folders hold torch.save(model): a pickle, which weights_only refuses."""
    torch.save(_member("htcnn1", seed=0), tmp_path / "htcnn1.pt")
    with pytest.raises(ConfigError, match=r"htcnn1.pt holds objects other than tensors "
                                          r"\(htfl_dist.models.base.SplitModel\), which "
                                          r"torch.load\(weights_only=True\) refuses"):
        load_pretrained(_member("htcnn1", seed=0), _config(tmp_path, "htcnn1"))


def test_an_unreadable_file_and_two_files_for_one_member_are_refused(tmp_path):
    (tmp_path / "htcnn1.pt").write_bytes(b"not a torch file at all")
    with pytest.raises(ConfigError, match=r"htcnn1.pt cannot be read by torch.load"):
        load_pretrained(_member("htcnn1", seed=0), _config(tmp_path, "htcnn1"))
    _write_htcnn1(tmp_path)
    _write_htcnn1(tmp_path, name="htcnn1.pth")
    with pytest.raises(ConfigError, match=r"holds both htcnn1.pt and htcnn1.pth for htcnn1; keep one"):
        load_pretrained(_member("htcnn1", seed=0), _config(tmp_path, "htcnn1"))


def test_an_oversize_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    _write_htcnn1(tmp_path)
    size = (tmp_path / "htcnn1.pt").stat().st_size
    monkeypatch.setattr(pretrained_module, "MAX_WEIGHTS_BYTES", size - 1)

    def never(*args, **kwargs):
        raise AssertionError("an oversize file was opened or loaded")

    monkeypatch.setattr(pretrained_module.torch, "load", never)
    monkeypatch.setattr(pretrained_module, "open", never, raising=False)  # the module's open(): not a byte read
    with pytest.raises(ConfigError, match=r"htcnn1.pt is [\d.]+ MiB, more than the [\d.]+ MiB a weight file may hold"):
        load_pretrained(_member("htcnn1", seed=0), _config(tmp_path, "htcnn1"))


# ---------------------------------------------------------------- the experiment's identity


def test_the_keys_keep_every_shipped_config_hash_and_the_path_is_not_hashed(tmp_path):
    """At their defaults the keys are left out of the experiment (every shipped config keeps its
    hash); the directory's location is not hashed, that weights are loaded (and which part) is."""
    for path in sorted((REPO / "configs").glob("*.yaml")):
        model = load_config(str(path), []).experiment()["model"]
        assert "pretrained" not in model and "pretrained_part" not in model, path.name
    plain = load_config(None, []).config_hash()
    here = load_config(None, [f"model.pretrained={tmp_path / 'a'}"])
    moved = load_config(None, [f"model.pretrained={tmp_path / 'b'}"])
    whole = load_config(None, [f"model.pretrained={tmp_path / 'a'}", "model.pretrained_part=whole"])
    assert here.config_hash() == moved.config_hash() != plain
    assert len({plain, here.config_hash(), whole.config_hash()}) == 3
    assert load_config(None, ["model.pretrained="]).config_hash() == plain
    with pytest.raises(ConfigError, match=r"'model.pretrained_part' applies with model.pretrained=DIR"):
        load_config(None, ["model.pretrained_part=whole"])


# ---------------------------------------------------------------- whole runs

RUN = ("model.group=htcnn1,htcnn2", "train.lr=1e-20", "rounds=1", "checkpoint_every=1")
"""The smoke run (6 clients, FedProto) on two members, with a learning rate too small to move a
float32 weight: after round 1 every client's model is still the one it started the round with."""


def _weights_dir(directory: Path, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for offset, member in enumerate(("htcnn1", "htcnn2")):
        written[member] = _recognisable(_member(member, seed=0), seed=seed + offset)
        torch.save(written[member], directory / f"{member}.pt")
    return written


@pytest.mark.integration
@pytest.mark.parametrize("init", ["per_client", "htfllib"])
def test_a_run_starts_every_client_from_the_weights_with_its_own_head(tmp_path, cache_dir, init):
    """Every client's feature extractor after round 1 is its member's file, tensor for tensor; its
    head is the one model.init draws for it (per client, or HtFLlib's shared draw)."""
    weights = _weights_dir(tmp_path / "weights", seed=40)
    out = tmp_path / "run"
    simulate(SMOKE, [f"data.cache_dir={cache_dir}", *RUN, f"model.init={init}",
                     f"model.pretrained={tmp_path / 'weights'}"], out=out)
    checkpoint = out / "checkpoints" / "round_00001"
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    assert set(manifest["pretrained"]) == {"htcnn1.pt", "htcnn2.pt"}
    for client_id in range(6):
        member = ("htcnn1", "htcnn2")[client_id % 2]
        model = torch.load(checkpoint / f"client_{client_id}.pt", weights_only=True)["model"]
        initial = initial_client_model("htcnn1,htcnn2", client_id, 0, num_classes=10, feature_dim=512,
                                       inputs=FMNIST, init=init)
        for name, tensor in model.items():
            expected = weights[member][name] if name.startswith("feature_extractor.") \
                else initial.state_dict()[name]
            assert torch.equal(tensor, expected), (client_id, name)


@pytest.mark.integration
def test_a_resume_on_other_weight_files_is_refused_and_on_moved_ones_goes_on(tmp_path, cache_dir):
    _weights_dir(tmp_path / "weights", seed=60)
    out = tmp_path / "run"
    args = ["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}", *RUN]
    first = run_program([*args, f"model.pretrained={tmp_path / 'weights'}"])
    assert first.returncode == 0, first.stdout + first.stderr

    _weights_dir(tmp_path / "other", seed=61)  # same names and shapes, other values
    refused = run_program([*args, "rounds=2", f"model.pretrained={tmp_path / 'other'}", "--resume", "auto"])
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "started from other pre-trained weights (htcnn1.pt: " in lines[0], refused.stderr
    assert "resume with the model.pretrained files it started from" in lines[0]

    shutil.move(tmp_path / "weights", tmp_path / "moved")  # another place, the same bytes: the same run
    resumed = run_program([*args, "rounds=2", f"model.pretrained={tmp_path / 'moved'}", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [row["round"] for row in read_metrics(out)] == [1, 2]
