"""Reader for PFLlib / HtFLlib dataset directories.

Layout (as written by PFLlib's ``generate_*.py``, ``save_file``)::

    DIR/config.json          {"num_clients": N, "num_classes": C, ...}
    DIR/train/<id>.npz       np.savez_compressed(path, data={"x": ..., "y": int labels})
    DIR/test/<id>.npz

What ``x`` holds decides the input kind (:class:`~htfl_dist.models.InputSpec`):

* ``N x C x H x W`` numbers: ``image`` (pictures; HAR's ``9 x 1 x 128`` and PAMAP2's
  ``9 x 3 x 256`` sensor windows too), read as float32 (uint8 kept as it is);
* ``N x F`` numbers: ``tabular`` (Amazon Review's 5000 features), float32;
* an object array of ``(token ids padded to L, length)`` pairs (AG News, SogouNews): ``text``,
  turned into int64 rows of ``L + 1`` numbers, the ids then the length.

The ``data`` entry is a pickled dict (a 0-d object array), so reading needs
``allow_pickle=True``, which can run arbitrary code from a hostile file: it is done only
when the user sets ``data.allow_pickle=true``.

Numbers read from the files size what is built from them (the class-count table, every
client's head, a text model's embedding), so each is bounded before anything is allocated:
``num_classes`` by :data:`MAX_CLASSES` (and, once the labels are read, by
:func:`check_class_count`), token ids by the vocabulary (``data.vocab_size``, else
:data:`MAX_VOCAB_SIZE`), and labels by ``num_classes``.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from htfl_dist.errors import ConfigError, DataError

MAX_CLASSES = 100_000
"""The most classes config.json may declare: far above the datasets PFLlib generates (hundreds of
classes; ImageNet-21k's 21,841 would fit), and small enough that the class-count table
(num_clients rows of 8-byte counts) and each client's head stay bounded whatever a damaged file
says (a billion made a 44.7 GiB table)."""

MAX_VOCAB_SIZE = 1_000_000
"""The largest vocabulary token ids may imply when ``data.vocab_size`` is unset: above PFLlib's
own text vocabularies (98,635 words for AG News, 399,198 for SogouNews). A larger id is a
damaged file, and its embedding (vocabulary x feature_dim floats per model) would not fit."""

CLASS_FLOOR, CLASS_FACTOR = 1000, 10
"""config.json's num_classes may exceed the largest label + 1 (a directory need not hold every
class) up to max(CLASS_FLOOR, CLASS_FACTOR x (largest label + 1)): ImageNet's 1000 classes are
always accepted, and a tenfold excess beyond that is a typo or another dataset's config, whose
empty classes would still cost a column in every head and in every class-count row."""


def pickle_refusal(directory: str) -> DataError:
    return DataError(
        f"cannot read {directory}: PFLlib .npz files hold pickled Python objects; set "
        f"data.allow_pickle=true if you trust {directory}"
    )


def read_pfllib_config(directory: str, num_clients: int) -> dict:
    """Parse ``config.json`` and check it matches the run's ``num_clients``."""
    if not os.path.isdir(directory):
        raise DataError(
            f"PFLlib dataset directory {directory} does not exist; set data.pfllib_dir=DIR "
            f"holding config.json, train/ and test/"
        )
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise DataError(
            f"PFLlib dataset directory {directory} lacks config.json; point data.pfllib_dir at "
            f"the folder PFLlib's generate_*.py wrote (config.json, train/, test/)"
        )
    try:
        with open(path) as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot parse {path} as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise DataError(f"{path} must hold a JSON object with num_clients and num_classes")
    for key in ("num_clients", "num_classes"):
        if not isinstance(config.get(key), int) or isinstance(config[key], bool) or config[key] < 1:
            raise DataError(f"{path} lacks a positive integer '{key}'")
    if config["num_classes"] > MAX_CLASSES:
        raise DataError(f"PFLlib directory {directory}: config.json num_classes={config['num_classes']} exceeds "
                        f"{MAX_CLASSES}, the most classes accepted; correct config.json (PFLlib's generators write "
                        f"the dataset's class count there)")
    if config["num_clients"] != num_clients:
        raise ConfigError(
            f"num_clients is {num_clients} but PFLlib dataset {directory} was split for "
            f"{config['num_clients']} clients; set num_clients={config['num_clients']}"
        )
    missing = [
        os.path.join(part, f"{cid}.npz")
        for part in ("train", "test")
        for cid in range(num_clients)
        if not os.path.isfile(os.path.join(directory, part, f"{cid}.npz"))
    ]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise DataError(f"PFLlib dataset directory {directory} lacks {shown}")
    return config


def pfllib_fingerprint(directory: str, num_clients: int) -> dict:
    """config.json's content hash plus (size, mtime) of every client file."""
    with open(os.path.join(directory, "config.json"), "rb") as handle:
        config_digest = hashlib.sha256(handle.read()).hexdigest()
    files = []
    for part in ("train", "test"):
        for cid in range(num_clients):
            stat = os.stat(os.path.join(directory, part, f"{cid}.npz"))
            files.append([f"{part}/{cid}", int(stat.st_size), int(stat.st_mtime_ns)])
    return {"config_sha256": config_digest, "files": files}


def input_kind_of(x: np.ndarray) -> str:
    """The input kind of an ``x`` :func:`read_pfllib_file` returned (int64 rows are text)."""
    if x.ndim == 4:
        return "image"
    return "text" if x.dtype == np.int64 else "tabular"


def check_class_count(directory: str, num_classes: int, largest_label: int) -> None:
    """config.json's num_classes against the labels the files hold (see :data:`CLASS_FACTOR`)."""
    allowed = max(CLASS_FLOOR, CLASS_FACTOR * (largest_label + 1))
    if num_classes > allowed:
        raise DataError(f"PFLlib directory {directory}: config.json num_classes={num_classes} exceeds {allowed}, "
                        f"the most accepted when the largest label is {largest_label} ({CLASS_FACTOR} x "
                        f"{largest_label + 1} classes, at least {CLASS_FLOOR}); correct config.json to the dataset's "
                        f"class count")


def check_labels(path: str, y: np.ndarray, num_classes: int) -> None:
    """Every label of ``y`` (one file's) in 0..num_classes - 1, as config.json declares."""
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        bad = int(y.min()) if y.min() < 0 else int(y.max())
        raise DataError(f"{path}: label {bad} in y is outside 0..{num_classes - 1} "
                        f"(config.json says num_classes={num_classes})")


def _check_vocabulary(tokens: np.ndarray, path: str, vocab_size: int | None) -> None:
    """Token ids in 0..vocabulary - 1: ``data.vocab_size`` when set, else :data:`MAX_VOCAB_SIZE`
    (the text models embed every id below the largest, so one wild id sizes the model)."""
    size = vocab_size if vocab_size is not None else MAX_VOCAB_SIZE
    low, high = int(tokens.min()), int(tokens.max())
    if low >= 0 and high < size:
        return
    source = "data.vocab_size" if vocab_size is not None else "the most accepted while data.vocab_size is unset"
    raise DataError(f"{path}: token id {low if low < 0 else high} in x is outside the vocabulary of {size} "
                    f"({source})")


def _token_rows(x: np.ndarray, path: str, vocab_size: int | None) -> np.ndarray:
    """AG News pairs ``(ids padded to L, length)`` as int64 rows ``ids..., length`` (N x L+1).

    ``np.array(pairs, dtype=object)`` gives an N x 2 array (the generator's case); a 1-D array
    of pair objects is read the same way. Ids must lie in the vocabulary (``vocab_size``:
    ``data.vocab_size``, None for the cap)."""
    try:
        pairs = [(row[0], row[1]) for row in x] if (x.ndim == 2 and x.shape[1] == 2) or x.ndim == 1 else None
    except (TypeError, IndexError, KeyError):
        pairs = None
    if pairs is None:
        raise DataError(f"{path}: x is an object array of shape {x.shape}; text must be (token ids, length) "
                        f"pairs as PFLlib's generate_AGNews.py writes them")
    try:
        tokens = np.array([np.asarray(ids, dtype=np.int64) for ids, _ in pairs])
        lengths = np.array([int(length) for _, length in pairs], dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:  # Overflow: an id beyond int64
        raise DataError(f"{path}: text pairs must hold integer token ids padded to one length and an integer "
                        f"length ({exc})") from None
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise DataError(f"{path}: token ids must be padded to one length (got {tokens.shape})")
    _check_vocabulary(tokens, path, vocab_size)
    if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
        raise DataError(f"{path}: sequence lengths must lie in 1..{tokens.shape[1]} (the padded length), got "
                        f"{int(lengths.min())}..{int(lengths.max())}")
    return np.concatenate([tokens, lengths[:, None]], axis=1)


def read_pfllib_file(path: str, allow_pickle: bool, directory: str, *,
                     vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One client file as (x, y), y int64 N and x by kind (see the module docstring): float32
    (or uint8) N x C x H x W, float32 N x F, or int64 text rows N x (L + 1), their token ids
    within ``vocab_size`` (``data.vocab_size``; None: within :data:`MAX_VOCAB_SIZE`)."""
    if not allow_pickle:
        raise pickle_refusal(directory)
    try:
        with np.load(path, allow_pickle=True) as archive:
            if "data" not in archive.files:
                raise DataError(f"{path} has no 'data' entry (entries: {', '.join(archive.files)})")
            payload = archive["data"]
    except DataError:
        raise
    except Exception as exc:  # a consented pickle can fail in any way (UnpicklingError, missing module, ...)
        raise DataError(f"cannot read {path} ({type(exc).__name__}: {exc}); replace the file") from None
    if isinstance(payload, np.ndarray) and payload.dtype == object and payload.shape == ():
        payload = payload.item()
    if not isinstance(payload, dict) or "x" not in payload or "y" not in payload:
        raise DataError(f"{path}: 'data' must be a dict with keys 'x' and 'y'")
    x = np.asarray(payload["x"])
    y = np.asarray(payload["y"])
    text = x.dtype == object and x.size > 0
    if text:
        x = _token_rows(x, path, vocab_size)
    elif x.dtype == object or x.ndim not in (2, 4) or not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
        if x.size == 0 and y.size == 0:  # an empty client; the caller gives it the others' shape
            return np.zeros((0,), dtype=np.float32), y.astype(np.int64)
        raise DataError(f"{path}: x has shape {x.shape} ({x.dtype}); supported: N x C x H x W arrays (images, "
                        f"sensor windows), N x F features (tabular), or N (token ids, length) pairs (text)")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise DataError(f"{path}: y has shape {y.shape} but x holds {x.shape[0]} samples")
    if not text and (x.dtype != np.uint8 or x.ndim == 2):  # numbers, not text: float32
        x = x.astype(np.float32, copy=False)
        if x.size and not np.isfinite(x).all():
            raise DataError(f"{path}: x holds NaN or Inf values")
    if y.size and not np.issubdtype(y.dtype, np.integer) and not np.all(np.equal(np.mod(y, 1), 0)):
        raise DataError(f"{path}: y holds non-integer labels")
    return np.ascontiguousarray(x), y.astype(np.int64)
