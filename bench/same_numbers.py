"""Same numbers before and after a refactoring: every registered algorithm's smoke run (2 rounds of
configs/smoke.yaml with its conformance overrides, in one process, one thread) played at a git
revision and at the working tree, row by row.

    python bench/same_numbers.py REVISION [--algorithms fedproto,fedtgp] [--keep DIR]

The revision is checked out into a temporary git worktree (nothing in this checkout changes) and
imported from there. Exit status 0 when every row is identical in the maths (accuracy, AUC, loss,
the papers' byte counts, measured bytes), 1 otherwise, with the first difference per algorithm.
Algorithms registered only on one side are listed, not compared. Both sides share one partition
cache (its files are keyed by the data config), so the data are byte-identical.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = ("round", "test_acc", "test_head_acc", "test_auc", "train_loss", "bytes_up", "bytes_down",
        "bytes_theory_up", "bytes_theory_down")

PLAY = r'''
import json, sys, tempfile
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from htfl_dist.algorithms import algorithm_names, get_algorithm
from htfl_dist.runtime.simulate import simulate
wanted = [name for name in sys.argv[4].split(",") if name] or algorithm_names()
rows = {}
for name in wanted:
    if name not in algorithm_names():
        continue
    with tempfile.TemporaryDirectory() as out:
        played = simulate(f"{sys.argv[1]}/configs/smoke.yaml", [f"algorithm={name}", "rounds=2",
                          f"data.cache_dir={sys.argv[3]}", *get_algorithm(name).conformance.overrides], out=out)
    rows[name] = [{key: row.get(key) for key in json.loads(sys.argv[5])} for row in played]
json.dump(rows, open(sys.argv[2], "w"))
'''


def play(source: Path, cache: Path, algorithms: str, out: Path) -> dict[str, list[dict]]:
    """Every algorithm's rows, played by the htfl_dist found in ``source``."""
    subprocess.run([sys.executable, "-c", PLAY, str(source), str(out), str(cache), algorithms, json.dumps(KEYS)],
                   check=True, cwd=source, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def compare(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> list[str]:
    """One line per algorithm whose rows differ (the first differing key), and one per algorithm
    played on one side only."""
    lines = [f"{name}: only at the revision" for name in sorted(before.keys() - after.keys())]
    lines += [f"{name}: only in the working tree" for name in sorted(after.keys() - before.keys())]
    for name in sorted(before.keys() & after.keys()):
        for old, new in zip(before[name], after[name], strict=False):
            changed = [key for key in KEYS if old.get(key) != new.get(key)]
            if changed:
                key = changed[0]
                lines.append(f"{name}: round {old.get('round')}: {key} {old.get(key)!r} -> {new.get(key)!r}")
                break
        else:
            if len(before[name]) != len(after[name]):
                lines.append(f"{name}: {len(before[name])} rows -> {len(after[name])}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision")
    parser.add_argument("--algorithms", default="", help="comma-separated names (default: every registered one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch_dir = Path(scratch)
        worktree = scratch_dir / "revision"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), args.revision], cwd=REPO, check=True)
        try:
            cache = scratch_dir / "cache"
            before = play(worktree, cache, args.algorithms, scratch_dir / "before.json")
            after = play(REPO, cache, args.algorithms, scratch_dir / "after.json")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
    lines = compare(before, after)
    same = sorted(before.keys() & after.keys())
    print(f"{len(same) - sum(1 for line in lines if line.split(':')[0] in same)} of {len(same)} algorithms "
          f"identical to {args.revision} over {max((len(rows) for rows in after.values()), default=0)} rounds")
    for line in lines:
        print(line)
    return 1 if any(line.split(":")[0] in same for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
