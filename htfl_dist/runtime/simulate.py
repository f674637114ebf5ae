"""Play a whole run inside the calling process: the in-process driver for tests and notebooks.

``simulate`` starts as ``python -m htfl_dist.main`` starts (``runtime.session``: the config resolved
and checked, the rank's parts built) and runs the one round loop over the local transport. So seeding, client order,
upload screening, evaluation and the metrics rows are the program's own, while the process start,
the launcher and the run-directory lock are left out. A world of one rank hosts every client, and
results never depend on the world size, so its rows are the rows of any launch of the same config
(the launch tests hold the program to that).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def simulate(config_file: str | os.PathLike | None, overrides: Sequence[str] = (), *, out: str | os.PathLike,
             device: str = "cpu") -> list[dict[str, Any]]:
    """Run the config with ``overrides`` (dotted ``key=value`` strings) to its end in this process,
    writing its outputs under ``out``; return its metrics rows. Raises the program's errors
    (``ConfigError`` for a user mistake) instead of exiting."""
    from htfl_dist.metrics.writer import read_rows
    from htfl_dist.runtime.bootstrap import make_deterministic, software_versions
    from htfl_dist.runtime.loop import RunContext, start
    from htfl_dist.runtime.session import checked_config
    from htfl_dist.runtime.transport import LocalTransport

    config = checked_config(None if config_file is None else str(config_file), overrides, world_size=1)
    make_deterministic()  # as the program's ranks run
    run_dir = Path(out).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if config.runtime.threads:  # as a launched rank does: the thread count changes float sums
        torch.set_num_threads(config.runtime.threads)
    try:
        facts = {"versions": software_versions(), "launcher": "simulate"}  # summary.json, as a launch writes it
        start(RunContext(config, LocalTransport(), torch.device(device), run_dir, extra_summary=facts)).run()
    finally:
        torch.set_num_threads(threads)
    return read_rows(run_dir / "metrics.jsonl")
