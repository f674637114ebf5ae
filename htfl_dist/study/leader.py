"""The first process of a study's cell: ``python -I leader.py STUDY_PID COMMAND...`` asks Linux
for SIGTERM when the study dies (``prctl(PR_SET_PDEATHSIG)``, which ``exec`` keeps), then becomes
COMMAND. So a study that is killed, even with SIGKILL, takes its cells along: a cell gets the
SIGTERM of a stopped study and checkpoints at its round boundary (torchrun passes it on to its
ranks, which run in sessions of their own), instead of living on as an orphan that holds its run
directory. Standard library only, run by path with ``-I``: a cell starts a few milliseconds later.

A wrapper that ``exec``s rather than a ``preexec_fn``: the study process has threads (torch's),
and Python runs no code between ``fork`` and ``exec`` safely then. The signal comes when the
study's thread that started the cell ends: the scheduler starts every cell from its main thread.
"""
from __future__ import annotations

import os
import signal
import sys

# Run by path with -I: the package is found from this file's place (its __init__ imports nothing).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from htfl_dist.parent_death import ask_for_parent_death_signal

DEATH_SIGNAL = signal.SIGTERM
EXIT_CANNOT_START = 127


def main(argv: list[str]) -> int:
    study_pid, command = int(argv[1]), argv[2:]
    ask_for_parent_death_signal(DEATH_SIGNAL)
    if os.getppid() != study_pid:  # the study died before the request was in place: nobody waits for this cell
        return 128 + DEATH_SIGNAL
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"htfl_dist.study: error: cannot start the cell: {command[0]}: {exc.strerror}", file=sys.stderr,
              flush=True)
    return EXIT_CANNOT_START


if __name__ == "__main__":
    sys.exit(main(sys.argv))
