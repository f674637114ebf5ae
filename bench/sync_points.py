"""Where a run waits for the GPU: every host synchronisation of a one-process run, counted by
call site (issue 45: on a GPU a batch-10 step is bound by launches, so one sync per step turns
the overlap of Python and kernels into their sum).

Runs ``python -m htfl_dist.main`` in this process with CUDA's sync debug mode on (torch warns at
every synchronising call: ``.item()``, ``float()`` of a tensor, a copy to the host, a mask's
``nonzero``) and prints the sites, innermost project frames first, with how often each synced.
A site counted about once per local step is the one to remove; one per client or round is the
price of reading a result.

    python bench/sync_points.py --top 12 -- --config configs/smoke.yaml --out $OUT runtime.device=cuda

Everything after ``--`` is the program's own command line. Needs a CUDA GPU (the GPU suite's
machine); the sync mode is a torch setting of this process only.
"""
from __future__ import annotations

import argparse
import collections
import runpy
import sys
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SYNC_WARNING = "synchronizing"
"""What torch's warning says (``called a synchronizing CUDA operation``)."""


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, program = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=12, help="how many sites to print")
    parser.add_argument("--depth", type=int, default=3, help="project frames shown per site")
    args = parser.parse_args(ours)
    if not program:
        parser.error("give the program's command line after --")
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: CUDA's sync debug mode has nothing to watch on a CPU")
    sites: collections.Counter[tuple[str, ...]] = collections.Counter()
    shown = warnings.showwarning

    def count(message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING in str(message):
            sites[project_frames(traceback.extract_stack(), args.depth)] += 1
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")  # every one, not once per line
    warnings.showwarning = count
    torch.cuda.set_sync_debug_mode("warn")
    sys.argv = ["htfl_dist.main", *program]
    code = 0
    try:
        runpy.run_module("htfl_dist.main", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        print(f"\nsync_points: {sum(sites.values())} host synchronisations at {len(sites)} sites "
              f"(program exit {code}); the {min(args.top, len(sites))} most frequent:")
        for frames, times in sites.most_common(args.top):
            print(f"{times:8d}  " + "\n          <- ".join(frames or ("(outside the repository)",)))
    return code


if __name__ == "__main__":
    sys.exit(main())
