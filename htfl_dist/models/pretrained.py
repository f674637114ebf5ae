"""Pre-trained client weights (``model.pretrained: DIR``): one weight file per architecture,
loaded into each client's freshly built model before its first round.

**Layout.** ``DIR/ARCH.pt`` (or ``.pth``) holds a ``torch.save``-d state dict (a mapping of names to
tensors, nothing else). With ``model.pretrained_part: features`` (the default) only the feature
extractor is loaded, so every member ``ARCH`` or ``ARCH:HEAD`` of the group reads ``ARCH.pt`` (the
head stays as ``model.init`` drew it: its class count is the data's, not ImageNet's). With
``whole`` the head is loaded too, so a member with a head other than its architecture's own reads
``ARCH+HEAD.pt`` (``resnet34+fc512.pt`` for ``resnet34:fc512``; ``+`` because ``:`` in a file name
trips scp, rsync and Windows), and ``ARCH`` or ``ARCH:fc`` reads ``ARCH.pt``.

**Tensor names.** A file may be written in either of two layouts, told apart by its names:

* torchvision's (or our feature extractor's) own: ``conv1.weight``, ``layer1.0.bn1.running_mean``,
  ... as ``torchvision.models.resnet18(weights=...).state_dict()`` or
  ``model.feature_extractor.state_dict()`` writes them. Our torchvision members *are* the
  torchvision module with its final classifier (``fc``, ``classifier``, ``heads``) replaced by a
  parameter-free :class:`~htfl_dist.models.head_split.FeaturePool`, so every other name is the
  same; the ImageNet classifier's tensors (``fc.weight``, ``fc.bias``, ``classifier.1.*``,
  ``heads.head.*``) are what that pool replaced and are skipped. ``features`` only.
* a whole model's: ``feature_extractor.*`` and ``head.*``, as ``model.state_dict()`` of a
  :class:`~htfl_dist.models.base.SplitModel` writes them, or HtFLlib's ``base.*`` and ``head.*``
  (its BaseHeadSplit, whose ``base`` of a torchvision member has torchvision's names);
  ``features`` loads the first and skips the head, ``whole`` loads both.

Everything is checked before a tensor is copied, and each refusal is one :class:`ConfigError`
line naming the file and the tensor: a missing file for a member the run uses, a file over
:data:`MAX_WEIGHTS_BYTES` (checked before it is read), a file ``torch.load(weights_only=True)``
refuses (a pickled module or any other object) or cannot read, an entry that is not a tensor, a
tensor the loaded part lacks or has but the file lacks, a shape that differs, and a non-finite
value. safetensors files are not read: this install has no ``safetensors`` package (the error
for a missing ``ARCH.pt`` says so when ``ARCH.safetensors`` is there).

**Identity.** Where the directory lives is not part of the experiment (like ``data.root``); that
weights are loaded, and which part, is. The sha256 of each file used goes into every checkpoint's
manifest (:func:`pretrained_identity`), and a resume on other bytes is refused
(:func:`pretrained_change`). Every client of an architecture gets the same weights, on any rank
and any world size; the rest of its model keeps ``model.init``'s draw (loading draws nothing).
"""
from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from htfl_dist.errors import ConfigError, shown

from .base import SplitModel
from .head_split import FeaturePool
from .registry import members_in_use, own_head, split_architecture

if TYPE_CHECKING:
    from htfl_dist.config import Config

SUFFIXES: tuple[str, ...] = (".pt", ".pth")
"""What a weight file's name may end in (both are ``torch.save`` archives)."""
HEAD_FILE_SEPARATOR = "+"
"""Joins ``ARCH`` and ``HEAD`` in a ``whole`` file's name (``resnet34+fc512.pt``)."""
MAX_WEIGHTS_BYTES = 2 << 30
"""The largest weight file read (2 GiB; torchvision's ViT-B/16, the largest member here, is
330 MB), checked on the file's size before a byte is read and again while reading."""
CACHED_BYTES = 2 << 30
"""Files read once per process and kept (their tensors on the CPU) while their total stays under
this, so a rank building many clients of one architecture reads its file once."""

_EXTRACTOR_PREFIX = "feature_extractor."
_HEAD_PREFIX = "head."
WHOLE_MODEL_PREFIXES: tuple[str, ...] = (_EXTRACTOR_PREFIX, "base.")
"""How a whole model's state dict names its feature extractor: ours (SplitModel), HtFLlib's
(BaseHeadSplit's ``base``); the head is ``head`` in both."""


def _directory(config: Config) -> Path:
    assert config.model.pretrained is not None
    directory = Path(os.path.expanduser(config.model.pretrained))
    if not directory.is_dir():
        raise ConfigError(f"model.pretrained: {shown(str(directory))} is not a directory (it holds one weight file "
                          f"per architecture, docs/datasets.md)")
    return directory


def weight_file_stem(member: str, part: str) -> str:
    """The file name, less its suffix, that ``member`` (``ARCH`` or ``ARCH:HEAD``) reads for ``part``."""
    arch, head = split_architecture(member)
    if part == "features" or head == own_head(arch):
        return arch
    return f"{arch}{HEAD_FILE_SEPARATOR}{head}"


def weight_file(directory: Path, member: str, part: str) -> Path:
    """``member``'s weight file in ``directory``; one ConfigError line if there is none, or two."""
    stem = weight_file_stem(member, part)
    found = [directory / f"{stem}{suffix}" for suffix in SUFFIXES if (directory / f"{stem}{suffix}").is_file()]
    if len(found) > 1:
        raise ConfigError(f"model.pretrained: {directory} holds both {found[0].name} and {found[1].name} for "
                          f"{member}; keep one")
    if not found:
        hint = ""
        if (directory / f"{stem}.safetensors").exists():
            hint = (f"; {stem}.safetensors is there, but this install reads torch.save files only (no safetensors "
                    f"package): convert it with torch.save(safetensors.torch.load_file(F), '{stem}.pt')")
        raise ConfigError(f"model.pretrained: no weights for {member} in {directory}: expected {stem}.pt{hint} "
                          f"(every architecture the run's clients use needs its file, docs/datasets.md)")
    return found[0]


def files_in_use(config: Config) -> dict[str, Path]:
    """Member -> its weight file, for every member the run's clients get; ``{}`` without
    ``model.pretrained``. One ConfigError line for the first member without its file."""
    if config.model.pretrained is None:
        return {}
    directory = _directory(config)
    return {member: weight_file(directory, member, config.model.pretrained_part)
            for member in _members(config.model.group, config.num_clients)}


@functools.lru_cache(maxsize=16)
def _members(group: str, num_clients: int) -> tuple[str, ...]:
    """``members_in_use``, kept: the factory asks for every client it builds (1000s per rank)."""
    return tuple(members_in_use(group, num_clients))


def _stat_key(path: Path) -> tuple[str, int, int, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev


def _check_size(path: Path, size: int) -> None:
    if size > MAX_WEIGHTS_BYTES:
        raise ConfigError(f"model.pretrained: {path} is {_amount(size)}, more than the {_amount(MAX_WEIGHTS_BYTES)} "
                          f"a weight file may hold; is it a weight file?")


def _amount(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size} bytes"


def _read_bytes(path: Path) -> bytes:
    _check_size(path, path.stat().st_size)
    with open(path, "rb") as handle:
        data = handle.read(MAX_WEIGHTS_BYTES + 1)  # a file that grew since its size was read
    _check_size(path, len(data))
    return data


_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}
_LOADED: OrderedDict[tuple[str, int, int, int, int], dict[str, Tensor]] = OrderedDict()


def file_sha256(path: Path) -> str:
    """The sha256 of ``path``'s bytes (kept per process while the file's size and mtime stay)."""
    key = _stat_key(path)
    digest = _DIGESTS.get(key)
    if digest is None:
        _check_size(path, key[1])
        hasher = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                hasher.update(chunk)
        digest = _DIGESTS[key] = hasher.hexdigest()
    return digest


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """The state dict in ``path`` (tensors on the CPU), read with ``torch.load(weights_only=True)``
    after its size is checked; one ConfigError line unless it is a mapping of names to tensors.
    Kept per process (see :data:`CACHED_BYTES`): callers must not change the tensors."""
    key = _stat_key(path)
    state = _LOADED.get(key)
    if state is not None:
        _LOADED.move_to_end(key)
        return state
    data = _read_bytes(path)
    _DIGESTS[key] = hashlib.sha256(data).hexdigest()
    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        if refused:  # a pickled object: torch.save(model), HtFLlib's -mfn files
            raise ConfigError(f"model.pretrained: {path} holds objects other than tensors ({refused.group(1)}), "
                              f"which torch.load(weights_only=True) refuses; save model.state_dict() "
                              f"instead") from None
        raise ConfigError(f"model.pretrained: {path} cannot be read by torch.load (not a torch.save file, or "
                          f"cut short)") from None
    except Exception as exc:  # a corrupt archive, a truncated file
        raise ConfigError(f"model.pretrained: {path} cannot be read by torch.load ({type(exc).__name__}: not a "
                          f"torch.save file, or cut short)") from None
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"model.pretrained: {path} holds a {type(loaded).__name__}, not a state dict (a mapping "
                          f"of tensor names to tensors)")
    for name, value in loaded.items():
        if not isinstance(name, str) or not isinstance(value, Tensor):
            raise ConfigError(f"model.pretrained: {path}: entry {shown(name)} is a {type(value).__name__}, not a "
                              f"tensor; a weight file holds a state dict and nothing else")
    state = dict(loaded)
    _LOADED[key] = state
    while len(_LOADED) > 1 and sum(_bytes(kept) for kept in _LOADED.values()) > CACHED_BYTES:
        _LOADED.popitem(last=False)
    return state


def _bytes(state: dict[str, Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def _replaced_classifier_prefixes(extractor: nn.Module) -> tuple[str, ...]:
    """Where our extractor has a parameter-free pool in place of torchvision's classifier."""
    return tuple(f"{name}." for name, module in extractor.named_modules() if name and isinstance(module, FeaturePool))


def _whole_model_prefix(state: dict[str, Tensor]) -> str:
    """The feature extractor's prefix in a whole-model state dict: ours (``feature_extractor.``) or
    HtFLlib's BaseHeadSplit (``base.``); '' for a feature extractor's own state dict."""
    for prefix in WHOLE_MODEL_PREFIXES:
        if any(name.startswith(prefix) for name in state):
            return prefix
    return ""


def _part_state(state: dict[str, Tensor], target: nn.Module, part: str, path: Path, member: str
                ) -> tuple[dict[str, tuple[str, Tensor]], Callable[[str], str]]:
    """The file's tensors under the names of ``target`` (the part being loaded), each with the
    name the file gives it, and how the file would name a tensor of ``target``; one ConfigError
    line for a tensor of a whole-model file that belongs to neither part."""
    prefix = _whole_model_prefix(state)
    if part == "whole":
        if prefix == "base.":  # HtFLlib's names: base.* is our feature_extractor.*
            return ({_EXTRACTOR_PREFIX + name.removeprefix(prefix) if name.startswith(prefix) else name: (name, tensor)
                     for name, tensor in state.items()},
                    lambda name: "base." + name.removeprefix(_EXTRACTOR_PREFIX)
                    if name.startswith(_EXTRACTOR_PREFIX) else name)
        return {name: (name, tensor) for name, tensor in state.items()}, lambda name: name
    if prefix:
        mapped = {}
        for name, tensor in state.items():
            if name.startswith(prefix):
                mapped[name.removeprefix(prefix)] = (name, tensor)
            elif not name.startswith(_HEAD_PREFIX):
                raise ConfigError(f"model.pretrained: {path}: unexpected tensor {shown(name)}: a whole-model state "
                                  f"dict holds {prefix}* and {_HEAD_PREFIX}* only ({member})")
        return mapped, lambda name: prefix + name
    skipped = _replaced_classifier_prefixes(target)
    return ({name: (name, tensor) for name, tensor in state.items() if not name.startswith(skipped)},
            lambda name: name)


def _first_conv_weight(target: nn.Module) -> str:
    for name, module in target.named_modules():
        if isinstance(module, nn.Conv2d):
            return f"{name}.weight"
    return ""


@torch.no_grad()
def load_weights(model: SplitModel, member: str, path: Path, part: str) -> None:
    """Copy ``path``'s weights into ``model``'s ``part`` (``features``: the feature extractor;
    ``whole``: the model), after checking every tensor; see the module docstring for the names."""
    state = read_state_dict(path)
    target: nn.Module = model.feature_extractor if part == "features" else model
    what = "feature extractor" if part == "features" else "model"
    mapped, written_as = _part_state(state, target, part, path, member)
    expected = target.state_dict()
    for name in expected:
        if name not in mapped:
            hint = ("; model.pretrained_part=whole needs the whole model's state dict (feature_extractor.*, "
                    "head.*), as model.state_dict() writes it") if part == "whole" else ""
            raise ConfigError(f"model.pretrained: {path} lacks tensor {shown(written_as(name))} of {member}'s "
                              f"{what}{hint}")
    stem = _first_conv_weight(target)
    for name, (written, tensor) in mapped.items():
        if name not in expected:
            raise ConfigError(f"model.pretrained: {path}: unexpected tensor {shown(written)}: {member}'s {what} has "
                              f"no such tensor")
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            hint = (f" (the data has {want[1]} channel(s): docs/datasets.md shows how to fold ImageNet's 3)"
                    if name == stem and len(want) == 4 and tensor.dim() == 4 else "")
            raise ConfigError(f"model.pretrained: {path}: tensor {shown(written)} has shape {tuple(tensor.shape)} "
                              f"but {member}'s has {want}{hint}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ConfigError(f"model.pretrained: {path}: tensor {shown(written)} holds values that are not finite "
                              f"(NaN or inf)")
    target.load_state_dict({name: tensor for name, (_, tensor) in mapped.items()}, strict=True)


def load_pretrained(model: SplitModel, config: Config) -> None:
    """With ``model.pretrained``, replace the freshly built client model's ``model.pretrained_part``
    by its member's weights (``model.arch`` names the member); otherwise do nothing. The runtime's
    client factory calls it for every client it builds (never for a shell that a checkpoint or a
    parked state fills), so a resumed client keeps its own weights. Every member the run uses must
    have its file, checked on each call (a missing one is named before any client trains)."""
    if config.model.pretrained is None:
        return
    files = files_in_use(config)
    member = model.arch
    if member not in files:
        raise ConfigError(f"model.pretrained: {member} is not a member that model.group={config.model.group} gives "
                          f"clients 0..{config.num_clients - 1}")
    load_weights(model, member, files[member], config.model.pretrained_part)


def pretrained_identity(config: Config) -> dict[str, str]:
    """File name -> sha256 of every weight file the run uses (``{}`` without ``model.pretrained``):
    what a checkpoint's manifest records."""
    return {path.name: file_sha256(path) for path in sorted(set(files_in_use(config).values()))}


def pretrained_change(saved: object, config: Config) -> str:
    """'FILE: SAVED -> NOW' for the weight files that differ from those a checkpoint's clients
    started from (``saved``: the manifest's record); '' when they match, or when either side has
    none (a manifest written before weights were recorded)."""
    if not isinstance(saved, dict) or config.model.pretrained is None:
        return ""
    now = pretrained_identity(config)
    changes = [f"{name}: {str(saved.get(name, 'none'))[:12]} -> {now.get(name, 'none')[:12]}"
               for name in sorted(set(saved) | set(now)) if saved.get(name) != now.get(name)]
    return "; ".join(changes[:3])


__all__ = [
    "HEAD_FILE_SEPARATOR",
    "MAX_WEIGHTS_BYTES",
    "SUFFIXES",
    "file_sha256",
    "files_in_use",
    "load_pretrained",
    "load_weights",
    "pretrained_change",
    "pretrained_identity",
    "read_state_dict",
    "weight_file",
    "weight_file_stem",
]
