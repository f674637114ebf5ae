"""No tracked file names a path outside the repository (issue 47): a scratch folder, a home
directory or another machine's checkout is something no reader has, so a command or a figure that
depends on one cannot be re-run from a clone.

The rule, applied to every text file ``git ls-files`` lists (a file with a NUL byte or that is not
UTF-8 is binary and skipped), except this one, whose examples of what the rule finds are its own
test cases:

- a *path token* is ``~/…``, ``$HOME/…``, ``${HOME}/…``, or an absolute path whose first component
  is a file-system root where machines keep system or user folders (``SYSTEM_ROOTS``), not glued to
  what comes before it (not the path of a URL, ``runs/x`` or ``a/b``, nor an HDF5 key like
  ``/client_3``, whose first component is no such root);
- it is accepted only if it is, or lies under, an entry of ``ALLOWED`` (each entry says why the
  project needs it); anything else, ``/tmp/…``, ``/root/…``, ``/home/…``, ``/work/…``,
  ``/Users/…`` and ``~/scratch`` among them, fails the test with the file, the line and the path.

A command in the docs that needs a folder of the user's names it by a placeholder
(``OUT=<scratch dir>``, ``REF=<clone of … at commit …>``) and uses ``$OUT``, which is no path token.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

SYSTEM_ROOTS = ("tmp", "var", "root", "home", "work", "Users", "mnt", "media", "scratch", "private", "Volumes",
                "opt", "srv", "usr", "etc", "proc", "dev", "sys", "run", "bin", "sbin", "lib", "lib64", "boot",
                "snap", "nfs", "gpfs", "lustre")
"""First components of an absolute path that name a folder of the machine, not of the repository.
(``/data`` is left out: the package's docstrings use ``/data/Cifar10`` as the example of a PFLlib
folder the user passes, a placeholder, not a folder of this machine.)"""

ALLOWED = (
    # The default Fashion-MNIST root: Debian's dataset-fashion-mnist package installs the IDX files
    # there (htfl_dist.config.data_section.DEFAULT_FMNIST_ROOT, launch/setup_env.sh, README).
    "/usr/share/datasets/fashion-mnist",
    # Interpreters and tools at their fixed system places: shebangs (#!/usr/bin/env), the GPU
    # scripts' and the Slurm tests' look-ups of system binaries.
    "/usr/bin", "/usr/sbin", "/sbin", "/bin/sh", "/bin/bash", "/bin/true",
    # Linux's process and kernel files: liveness reads /proc/sys and /proc/PID; tests read /proc and
    # /sys and name network namespaces under /run/netns.
    "/proc", "/sys", "/run/netns",
    # Device files every Linux system has: output thrown away, a source of zeros, shared memory.
    "/dev/null", "/dev/zero", "/dev/shm",
    # The resolver file the Slurm tests read to find a host name.
    "/etc/hosts",
    # The system temporary folder named as such, never a folder under it: bench/gpu_suite.py's
    # fallback when TMPDIR is unset, docs/clusters.md's "not /tmp". "/tmp/x" is not accepted.
    "/tmp$",
    # The per-user default of the virtual environment and of the partition caches
    # (launch/setup_env.sh, data.cache_dir): a place the program itself chooses, the same on every
    # machine, not a folder of the machine that wrote the docs.
    "~/.cache/htfl_dist",
)

_ROOTS = "|".join(SYSTEM_ROOTS)
PATH_TOKEN = re.compile(
    r"(?<![\w./\\~$}\])-])"                              # not glued to a word, a URL, a relative path
    rf"(?:(?:~|\$HOME|\$\{{HOME\}})/[^\s`'\"()<>|;,:\\]*"  # home-relative
    rf"|/(?:{_ROOTS})(?![\w.-])[^\s`'\"()<>|;,:\\]*)")   # absolute, under a system root
"""One path token (module docstring). It runs to the next blank, quote, bracket, pipe, ``;``, ``,``,
``:`` (a PATH list) or backslash (an escape in a string)."""


def is_allowed(token: str) -> bool:
    token = token.rstrip(".:")  # a path that ends a sentence
    for entry in ALLOWED:
        if entry.endswith("$"):
            if token == entry[:-1]:
                return True
        elif token == entry or token.startswith(entry + "/"):
            return True
    return False


def outside_paths(text: str) -> list[tuple[int, str]]:
    """(line number, token) of every path token in ``text`` that ``ALLOWED`` does not accept."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        found.extend((number, match.group(0)) for match in PATH_TOKEN.finditer(line)
                     if not is_allowed(match.group(0)))
    return found


SELF = Path(__file__).resolve().relative_to(REPO).as_posix()
"""This file: its examples name such paths on purpose."""


def tracked_text_files() -> dict[str, str]:
    """{path relative to the repository: its text} for every tracked file that is text, this one
    left out."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    texts = {}
    for name in listing.decode().split("\0"):
        path = REPO / name
        if not name or name == SELF or not path.is_file():  # not a file: deleted in the working tree
            continue
        raw = path.read_bytes()
        if b"\0" in raw:
            continue
        try:
            texts[name] = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


@pytest.mark.parametrize("text", [
    "cd /tmp/pn/bench/system && python run.py",
    "--out /tmp/htfl_helpers/fednh/run rounds=3",
    "export PYTHONPATH=/work/main",
    "see /root/.cache/other/venv",
    "cp -r my_plugin /home/me/src",
    "open /Users/me/Desktop/x.png",
    "python ~/scratch/compare.py",
    "ls $HOME/runs",
    "PATH=/usr/bin:/tmp/mine/bin",
    "(`git worktree add /tmp/c44809f c44809f`)",
    "the data under /usr/share/datasets/other",
    "a folder under /tmp/",
])
def test_a_path_outside_the_repository_is_found(text):
    assert outside_paths(text), text


@pytest.mark.parametrize("text", [
    "python -m htfl_dist.main --out $OUT/run rounds=3",
    "REF=<clone of regulationLee/ProtoNorm at e816cef>; cd $REF/system",
    "https://github.com/tmp/home/x and runs/tmp/x and bench/RESULTS.md",
    "Fashion-MNIST under /usr/share/datasets/fashion-mnist.",
    "#!/usr/bin/env bash",
    "exec 3>/dev/null; cat /proc/1/status /sys/fs/cgroup/x; PATH=/usr/bin:/usr/sbin:/sbin",
    "not `/tmp` but a shared folder",
    "the venv at ~/.cache/htfl_dist/venv",
    "h5['/client_3/train_x'], a/b, n/2, 1/‖x‖, PFLlib directory /data/Cifar10",
])
def test_what_the_project_uses_is_accepted(text):
    assert outside_paths(text) == [], text


def test_the_scan_reads_the_tracked_files_but_this_one():
    texts = tracked_text_files()
    assert "bench/RESULTS.md" in texts and "docs/algorithms.md" in texts and SELF not in texts


def test_no_tracked_file_names_a_path_outside_the_repository():
    offending = [f"{name}:{number}: {token}" for name, text in sorted(tracked_text_files().items())
                 for number, token in outside_paths(text)]
    assert not offending, (f"{len(offending)} path(s) outside the repository (tests/runtime/test_repository_paths.py "
                           f"says the rule and what is allowed):\n" + "\n".join(offending))
