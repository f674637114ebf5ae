"""Reader for PFLlib / HtFLlib dataset directories.

Layout (as written by PFLlib's ``generate_*.py``)::

    DIR/config.json          {"num_clients": N, "num_classes": C, ...}
    DIR/train/<id>.npz       np.savez_compressed(path, data={"x": float N x C x H x W, "y": ...})
    DIR/test/<id>.npz

The ``data`` entry is a pickled dict (a 0-d object array), so reading needs
``allow_pickle=True``, which can run arbitrary code from a hostile file: it is done only
when the user sets ``data.allow_pickle=true``.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from htfl_dist.errors import ConfigError, DataError


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
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise DataError(f"{path} lacks a positive integer '{key}'")
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


def read_pfllib_file(path: str, allow_pickle: bool, directory: str) -> tuple[np.ndarray, np.ndarray]:
    """One client file as (x, y): x float32 (or uint8) N x C x H x W, y int64 N."""
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
    if x.ndim != 4:
        raise DataError(f"{path}: x has shape {x.shape}; only image data (N x C x H x W) is supported")
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise DataError(f"{path}: y has shape {y.shape} but x holds {x.shape[0]} samples")
    if x.dtype != np.uint8:
        x = x.astype(np.float32, copy=False)
        if x.size and not np.isfinite(x).all():
            raise DataError(f"{path}: x holds NaN or Inf values")
    if y.size and not np.issubdtype(y.dtype, np.integer) and not np.all(np.equal(np.mod(y, 1), 0)):
        raise DataError(f"{path}: y holds non-integer labels")
    return np.ascontiguousarray(x), y.astype(np.int64)
