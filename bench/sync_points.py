"""Where a run waits for the GPU: every operation of a one-process run that makes the host wait
for the device, counted by call site (issue 45: on a GPU a batch-10 step is bound by launches,
so one wait per step turns the overlap of Python and kernels into their sum).

Runs ``python -m htfl_dist.main`` in this process under a torch dispatch mode that sees every
operator call and counts the ones that read a device's result on the host: a tensor's value
(``.item()``, ``float(t)``, ``bool(t)``: ``aten._local_scalar_dense``), an output whose size
depends on the values (``nonzero``, ``masked_select``, ``unique``, ...) and a copy between the
host and a device. On a CPU nothing waits, but the sites are the same ones, so the list is
made, and checked, without a GPU. Each site is printed with its innermost project frames and how
often it ran: about once per local step is the one to remove; once per client or round is the
price of reading a result.

    python bench/sync_points.py --top 12 -- --config configs/smoke.yaml --out $OUT rounds=2

Everything after ``--`` is the program's own command line (one process; a launcher's ranks are
other processes).
"""
from __future__ import annotations

import argparse
import collections
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent

VALUE_READS = frozenset({"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2",
                         "aten.unique_dim", "aten.unique_consecutive", "aten.repeat_interleave",
                         "aten.is_nonzero", "aten.equal", "aten.allclose"})
"""Operators whose result on the host needs the device's values (torch's own list of synchronising
calls in CUDA's sync debug mode, by operator)."""

COPIES = frozenset({"aten._to_copy", "aten.copy_"})
"""Operators that wait when they cross between the host and a device."""


def crosses_devices(name: str, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a copy moves data between the host and a device (``to``, ``.cpu()``, ``copy_``)."""
    tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
    devices = {tensor.device.type for tensor in tensors}
    if name == "aten._to_copy" and "device" in kwargs and kwargs["device"] is not None:
        devices.add(torch.device(kwargs["device"]).type)
    return "cpu" in devices and len(devices) > 1


def project_frames(stack: list[traceback.FrameSummary], depth: int) -> tuple[str, ...]:
    """The innermost ``depth`` frames of this repository (not this script), as file:line function."""
    here = Path(__file__).resolve()
    frames = []
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        if path == here or REPO not in path.parents:
            continue
        frames.append(f"{path.relative_to(REPO)}:{frame.lineno} {frame.name}")
        if len(frames) == depth:
            break
    return tuple(frames)


class HostWaits(TorchDispatchMode):
    """Counts value reads and host-device copies by (operator, call site)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.sites: collections.Counter[tuple[str, tuple[str, ...]]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in VALUE_READS or (name in COPIES and crosses_devices(name, args, kwargs)):
            self.sites[(name, project_frames(traceback.extract_stack(), self.depth))] += 1
        return func(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, program = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=12, help="how many sites to print")
    parser.add_argument("--depth", type=int, default=3, help="project frames shown per site")
    args = parser.parse_args(ours)
    if not program:
        parser.error("give the program's command line after --")
    sys.argv = ["htfl_dist.main", *program]
    waits = HostWaits(args.depth)
    code = 0
    try:
        with waits:
            runpy.run_module("htfl_dist.main", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    sites = waits.sites
    print(f"\nsync_points: {sum(sites.values())} host waits at {len(sites)} sites (program exit {code}); "
          f"the {min(args.top, len(sites))} most frequent:")
    for (name, frames), times in sites.most_common(args.top):
        print(f"{times:8d}  {name}")
        for frame in frames or ("(outside the repository)",):
            print(" " * 10 + frame)
    return code


if __name__ == "__main__":
    sys.exit(main())
