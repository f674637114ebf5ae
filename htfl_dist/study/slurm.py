"""A study as one SLURM array job: task i runs cell i through slurm/cpu.sbatch or slurm/gpu.sbatch.

The array's batch script is written into DIR/slurm/: the chosen script's own ``#SBATCH`` lines
(its requeue, append-mode log and early SIGTERM), then a ``case`` on ``SLURM_ARRAY_TASK_ID``
that picks the cell's arguments and ``exec``s the project's script with them. So every task is
exactly the job ``sbatch slurm/cpu.sbatch CONFIG --out CELL_DIR ...`` would be, requeue
included (an array task has a job id of its own, which the script requeues).
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Literal

from htfl_dist.study.plan import Cell, StudyError

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {"cpu": REPO / "slurm" / "cpu.sbatch", "gpu": REPO / "slurm" / "gpu.sbatch"}


def array_script(cells: list[Cell], out: Path, kind: Literal["cpu", "gpu"]) -> str:
    """The array job's batch script (see the module docstring)."""
    script = SCRIPTS[kind]
    header = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    arguments = [[str(cell.config_file), "--out", str(cell.run_dir(out)), *cell.program_overrides(out)]
                 for cell in cells]
    cases = [f"  {index}) set -- {shlex.join(args)} ;;" for index, args in enumerate(arguments)]
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Written by python -m htfl_dist.study: array task i runs cell i through {script}.",
        *header,
        "set -euo pipefail",
        'case "${SLURM_ARRAY_TASK_ID:?run this script with sbatch --array}" in',
        *cases,
        '  *) echo "htfl_dist.study: no cell for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;',
        "esac",
        f"exec bash {shlex.quote(str(script))} \"$@\"",
        "",
    ])


def submit(cells: list[Cell], out: Path, kind: Literal["cpu", "gpu"], at_once: int | None,
           sbatch_options: list[str], wait: bool) -> tuple[str, int]:
    """Submit the array over ``cells``; returns the job id and (with ``wait``) sbatch's exit status
    once every task has ended. Each submission gets its own script and cell list, so a rerun
    while an earlier array still runs cannot change what that array's tasks read."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise StudyError("--slurm needs sbatch on PATH (run on a SLURM login node)")
    folder = out / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    number = len(list(folder.glob("array-*.sh")))
    script = folder / f"array-{number}.sh"
    script.write_text(array_script(cells, out, kind))
    (folder / f"array-{number}.cells").write_text("".join(f"{i}\t{cell.name}\n" for i, cell in enumerate(cells)))
    limit = f"%{at_once}" if at_once else ""
    command = [sbatch, "--parsable", f"--array=0-{len(cells) - 1}{limit}", "--job-name=htfl_study",
               f"--output={folder}/array-{number}-task-%a.log", *sbatch_options, *(["--wait"] if wait else []),
               str(script)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.stdout, process.stderr
    assert stdout is not None and stderr is not None  # both PIPE
    job = stdout.readline().strip().split(";")[0]
    if not job.isdigit():
        _, error = process.communicate()
        raise StudyError(f"sbatch refused the array: {error.strip() or 'no job id'}")
    print(f"study: submitted array job {job} ({len(cells)} cells, tasks logged in "
          f"{folder}/array-{number}-task-N.log; task N = line N of {folder}/array-{number}.cells)", flush=True)
    if not wait:
        stdout.close()
        stderr.close()
        return job, 0
    process.communicate()
    return job, process.returncode
