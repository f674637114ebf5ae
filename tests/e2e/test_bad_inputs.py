"""The catalogue of bad input: every mistake the project knows a user makes, each ending in one
line on stderr (our format, no traceback), its exit status, and no changed file in the run
directory. In-process through ``htfl_dist.main.main`` (the same code a launch runs, minus the
interpreter start); tests/e2e/test_cli_errors.py launches the few that need a real process."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import SMOKE
from htfl_dist.main import LINE_CHARS, main
from htfl_dist.runtime.bootstrap import LOCK_FILE


def _stderr_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("htfl_dist: error: "), lines[0]
    assert len(lines[0]) <= len("htfl_dist: error: ") + LINE_CHARS, len(lines[0])
    return lines[0]


def _snapshot(directory: Path) -> dict[str, bytes] | None:
    """Every file under ``directory`` with its bytes (None: no directory), the lock file aside: it
    is the run directory's lock, not the run's data, and rank 0 makes it when it takes the
    directory (tests/e2e/test_nothing_lost.py checks what happens to it)."""
    if not directory.exists():
        return None
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def _refused(capsys, argv: list[str], out: Path, status: int, needles: list[str], *, leaves=None) -> str:
    """``main(argv)`` ends with ``status`` and one line holding every needle; the run directory
    is as it was (``leaves``: what it must hold afterwards, when it did not exist)."""
    before = _snapshot(out)
    began = time.monotonic()
    assert main(argv) == status
    line = _stderr_line(capsys)
    for needle in needles:
        assert needle in line, line
    assert time.monotonic() - began < 60
    assert _snapshot(out) == (before if leaves is None else leaves), "the run directory changed"
    return line


def _file(tmp_path: Path, text: str | bytes, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


# ------------------------------------------------------------------ mistakes in the config and the command line

def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\ndata:\n  root: *a{levels - 1}\n"


SMOKE_ARGS = ["--config", str(SMOKE)]

CONFIG_MISTAKES = [
    # (id, command line after --out (a callable of tmp_path for files), needles)
    ("unknown-algorithm", [*SMOKE_ARGS, "algorithm=fedfoo"],
     ["config key 'algorithm' is 'fedfoo'; registered:", "fedproto", "local", "--import MODULE"]),
    ("unknown-model-group", [*SMOKE_ARGS, "model.group=HtFE7"], ["unknown model group 'HtFE7'", "HtCNN8"]),
    ("beta-zero", [*SMOKE_ARGS, "data.beta=0"], ["data.beta", "> 0"]),
    ("beta-negative", [*SMOKE_ARGS, "data.beta=-1"], ["data.beta", "got -1"]),
    ("key-typo", [*SMOKE_ARGS, "data.partiton=dirichlet"],
     ["unknown config key 'data.partiton'", "did you mean 'data.partition'"]),
    ("closed-choice", [*SMOKE_ARGS, "on_bad_upload=ignore"], ["on_bad_upload", "skip, fail"]),
    ("not-an-integer", [*SMOKE_ARGS, "rounds=abc"], ["'rounds'", "integer"]),
    ("algorithm-option", [*SMOKE_ARGS, "algo.client_reg=foo"], ["algo.client_reg", "paper"]),
    ("infinite-timeout", [*SMOKE_ARGS, "runtime.timeout_s=.inf"], ["runtime.timeout_s", "finite"]),
    ("nan-lr", [*SMOKE_ARGS, "train.lr=.nan"], ["train.lr", "finite"]),
    ("lr-beyond-float32", [*SMOKE_ARGS, "train.lr=1e308"], ["train.lr", "float32", "got '1e308'"]),
    ("threshold-beyond-float32", [*SMOKE_ARGS, "data.beta=1e39"], ["data.beta", "float32"]),
    ("seed-beyond-int64", [*SMOKE_ARGS, "seed=1e30"], ["'seed'", "64 bits"]),
    ("billion-clients", [*SMOKE_ARGS, "num_clients=1000000000", "data.partition=pathological"],
     ["num_clients", "in [1, 1000000]", "got 1000000000"]),
    ("huge-feature-width", [*SMOKE_ARGS, "model.feature_dim=100000000"], ["model.feature_dim", "in [1, 65536]"]),
    ("heartbeat-below-floor", [*SMOKE_ARGS, "runtime.heartbeat_timeout_s=0.01"],
     ["runtime.heartbeat_timeout_s", "0 (off) or at least 3", "got 0.01"]),
    ("negative-divergence-limit", [*SMOKE_ARGS, "train.max_diverged_rounds=-1"], ["train.max_diverged_rounds"]),
    ("pfllib-without-dir", [*SMOKE_ARGS, "data.partition=pfllib"], ["data.pfllib_dir"]),
    ("petabyte-vocabulary", [*SMOKE_ARGS, "data.vocab_size=1000000000000"],
     ["config key 'data.vocab_size' must be in [1, 1000000]", "got 1000000000000"]),
    ("override-without-equals", [*SMOKE_ARGS, "rounds"], ["override 'rounds' must look like key=value"]),
    ("megabyte-value", [*SMOKE_ARGS, "rounds=" + "9x" * 500_000], ["'rounds' must be an integer", "..."]),
    ("megabyte-algorithm-name", [*SMOKE_ARGS, "algorithm=" + "x" * 1_000_000], ["config key 'algorithm' is", "x...x"]),
    ("alias-bomb-override", [*SMOKE_ARGS, "data.root=[&a [x, x, x, x, x, x, x, x, x, x], "
                                          "&b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a], "
                                          "&c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], "
                                          "[*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]]"],
     ["override data.root", "aliases expand to more than"]),
    ("unknown-flag", [*SMOKE_ARGS, "--rounds", "3"],
     ["unrecognized arguments: --rounds", "write rounds=VALUE"]),
    ("unknown-flag-with-value", [*SMOKE_ARGS, "--seed=4"], ["write seed=4"]),
    ("unknown-option", [*SMOKE_ARGS, "--bogus"], ["unrecognized arguments: --bogus", "--help"]),
    ("resume-from-nowhere", [*SMOKE_ARGS, "--resume", "/nonexistent/run"], ["--resume /nonexistent/run",
                                                                            "no such directory"]),
    ("missing-config-file", ["--config", "/nonexistent/nope.yaml"], ["nope.yaml", "does not exist"]),
    ("malformed-yaml", lambda tmp: ["--config", _file(tmp, "rounds: 3\ndata: [unclosed\n")],
     ["not valid YAML", "line"]),
    ("empty-config", lambda tmp: ["--config", _file(tmp, "")], ["is empty", "algorithm: NAME"]),
    ("comment-only-config", lambda tmp: ["--config", _file(tmp, "# only a comment\n")], ["is empty"]),
    ("not-utf8", lambda tmp: ["--config", _file(tmp, b"rounds: 2\n\xff\xfe: 1\n")],
     ["not UTF-8", "0xff", "offset 10"]),
    ("not-a-mapping", lambda tmp: ["--config", _file(tmp, "- rounds\n- 3\n")], ["must hold a mapping"]),
    ("duplicate-key", lambda tmp: ["--config", _file(tmp, "algorithm: fedproto\nrounds: 3\nseed: 0\n"
                                                          "data:\n  beta: 0.1\nrounds: 0\n")],
     ["key 'rounds' appears twice in one mapping, at lines 2 and 6"]),
    ("duplicate-nested-key", lambda tmp: ["--config", _file(tmp, "data:\n  beta: 0.1\n  subsample: 0.02\n"
                                                                 "  beta: -5\n")],
     ["key 'beta' appears twice", "lines 2 and 4"]),
    ("alias-bomb-file", lambda tmp: ["--config", _file(tmp, _alias_bomb())], ["aliases expand to more than"]),
    ("recursive-alias", lambda tmp: ["--config", _file(tmp, "data: &d\n  root: *d\n")], ["recursive structure"]),
    ("deep-nesting", lambda tmp: ["--config", _file(tmp, "data: " + "[" * 50_000 + "]" * 50_000 + "\n")],
     ["nested too deeply"]),
    ("section-not-a-mapping", lambda tmp: ["--config", _file(tmp, "data: 3\n")], ["'data' must be a mapping"]),
]


@pytest.mark.parametrize("argv,needles", [pytest.param(argv, needles, id=name) for name, argv, needles in
                                          CONFIG_MISTAKES])
def test_config_and_command_line_mistakes(tmp_path, capsys, argv, needles):
    """Refused before anything is written: the run directory never comes into existence."""
    out = tmp_path / "run"
    argv = argv(tmp_path) if callable(argv) else argv
    _refused(capsys, ["--out", str(out), *argv], out, 2, needles)


def test_empty_out_is_refused_not_taken_for_the_default(tmp_path, capsys, monkeypatch):
    """``--out "$RUN_DIR"`` with the variable unset would run into ./runs of the working directory."""
    monkeypatch.chdir(tmp_path)
    for empty in ("", "  "):
        _refused(capsys, ["--config", str(SMOKE), "--out", empty], tmp_path / "runs", 2,
                 ["--out is empty (an unset shell variable?)"])


def test_error_values_are_cut_short():
    from htfl_dist.errors import SHOWN_CHARS, shown

    nested: list = [1]
    for _ in range(50):
        nested = [nested] * 10  # 10^50 leaves when expanded: the repr must not walk them
    began = time.monotonic()
    assert len(shown(nested)) <= SHOWN_CHARS
    assert len(shown("x" * 10**7)) <= SHOWN_CHARS
    assert shown("abc") == "'abc'" and shown(0.01) == "0.01"
    assert time.monotonic() - began < 1


# ------------------------------------------------------------------ mistakes found once the data is looked at

DATA_MISTAKES = [
    ("fmnist-root-missing", ["data.root=/nonexistent/fmnist"],
     ["/nonexistent/fmnist", "apt-get install dataset-fashion-mnist"]),
    ("cifar-root-missing", ["data.dataset=cifar10", "data.root=/nonexistent"], ["/nonexistent"]),
    ("too-many-classes-per-client", ["data.partition=pathological", "data.classes_per_client=11"],
     ["classes_per_client", "10"]),
    ("more-clients-than-samples", ["num_clients=900000", "data.partition=pathological"],
     ["config key 'num_clients' is 900000", "samples to split", "lower num_clients"]),
]


@pytest.mark.parametrize("overrides,needles", [pytest.param(o, n, id=name) for name, o, n in DATA_MISTAKES])
def test_data_mistakes(tmp_path, capsys, cache_dir, overrides, needles):
    """Found by rank 0 after it took the run directory: it holds nothing but the lock file."""
    out = tmp_path / "run"
    _refused(capsys, ["--out", str(out), "--config", str(SMOKE), f"data.cache_dir={cache_dir}", *overrides],
             out, 2, needles, leaves={})


TRACE_HEADER = b"client,speed,bandwidth_mbps\n"


@pytest.mark.parametrize("name,data,needle", [
    ("trace.json", b'[{"client": 0, "speed": 1,\n "bandwidth_mbps": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]",
     "line 2, field 'bandwidth_mbps': nested more than Python's JSON reader can follow"),
    ("trace.csv", TRACE_HEADER + b"0,1,8\n1,0.5,caf\xe9\n", "line 3, field 'bandwidth_mbps': byte 0xe9 is not UTF-8"),
    ("trace.csv", TRACE_HEADER + b"0,1,8\n1," + b"7" * 1_200_000 + b",8\n",
     "line 3: field 'speed' holds 1200000 characters"),
], ids=["json-nested-deep", "csv-not-utf8", "csv-megabyte-cell"])
def test_a_trace_file_the_readers_choke_on_is_one_line_before_any_rank_talks(tmp_path, capsys, name, data, needle):
    """Were a RecursionError, a UnicodeDecodeError and csv's field-limit error with their tracebacks:
    now the start's config check names file, line and field, before the run directory exists."""
    trace = tmp_path / name
    trace.write_bytes(data)
    out = tmp_path / "run"
    for check in ([], ["--check"]):
        _refused(capsys, [*check, *SMOKE_ARGS, "--out", str(out), "participation.clock=true",
                          "participation.profile=trace", f"participation.trace={trace}"], out, 2,
                 [f"participation.trace {trace}: ", needle])


def test_data_root_without_expected_files(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "run"
    _refused(capsys, ["--out", str(out), "--config", str(SMOKE), f"data.root={empty}", f"data.cache_dir={tmp_path}"],
             out, 2, [str(empty), "train-images-idx3-ubyte"], leaves={})


def test_truncated_dataset_file(tmp_path, capsys):
    from htfl_dist.config import DEFAULT_FMNIST_ROOT

    root = tmp_path / "fmnist"
    shutil.copytree(DEFAULT_FMNIST_ROOT, root)
    victim = root / "t10k-labels-idx1-ubyte.gz"
    victim.write_bytes(victim.read_bytes()[:200])
    out = tmp_path / "run"
    _refused(capsys, ["--out", str(out), "--config", str(SMOKE), f"data.root={root}",
                      f"data.cache_dir={tmp_path / 'cache'}"], out, 2, ["t10k-labels-idx1-ubyte"],
             leaves={})


def _pfllib_text(directory: Path, *, wild_id: int | None = None, num_classes: int = 4) -> Path:
    """A 2-client PFLlib text directory as generate_AGNews.py writes it ((ids padded to 8, length)
    pairs in a pickled dict), with ``wild_id`` among client 1's train ids."""
    rng = np.random.default_rng(0)
    for part in ("train", "test"):
        (directory / part).mkdir(parents=True)
        for cid in range(2):
            rows = [[2, *rng.integers(4, 50, 7).tolist()] for _ in range(8)]
            if wild_id is not None and (part, cid) == ("train", 1):
                rows[0][3] = wild_id
            x = np.array([(ids, len(ids)) for ids in rows], dtype=object)
            np.savez_compressed(directory / part / f"{cid}.npz", data={"x": x, "y": rng.integers(0, 4, 8)})
    (directory / "config.json").write_text(json.dumps({"num_clients": 2, "num_classes": num_classes}))
    return directory


PFLLIB_MISTAKES = [
    ("token-id-beyond-the-vocabulary", {"wild_id": 10**12}, [],
     ["train/1.npz: token id 1000000000000 in x is outside the vocabulary of 1000000 (the most accepted while "
      "data.vocab_size is unset)"]),
    ("token-id-beyond-data.vocab_size", {"wild_id": 5000}, ["data.vocab_size=5000"],
     ["train/1.npz: token id 5000 in x is outside the vocabulary of 5000 (data.vocab_size)"]),
    ("billion-classes", {"num_classes": 1_000_000_000}, [],
     ["config.json num_classes=1000000000 exceeds 100000, the most classes accepted"]),
]


@pytest.mark.parametrize("files,overrides,needles", [pytest.param(f, o, n, id=name) for name, f, o, n in
                                                     PFLLIB_MISTAKES])
def test_pfllib_directory_mistakes(tmp_path, capsys, files, overrides, needles):
    """A number in the files that would size an allocation (a 2 PB embedding, a 44.7 GiB class-count
    table) is refused while the directory is read, naming the file and the field."""
    source = _pfllib_text(tmp_path / "AGNews", **files)
    out = tmp_path / "run"
    _refused(capsys, ["--out", str(out), "--config", str(SMOKE), "data.partition=pfllib", f"data.pfllib_dir={source}",
                      "data.allow_pickle=true", "data.subsample=1", "num_clients=2", "model.group=HtFE-txt-2",
                      f"data.cache_dir={tmp_path / 'cache'}", *overrides], out, 2, needles, leaves={})
    assert not list((tmp_path / "cache").glob("*.h5"))


# ------------------------------------------------------------------ mistakes about an existing run directory


@pytest.fixture
def finished_run(single_run, tmp_path) -> Path:
    """A copy of a finished 2-round smoke run with a checkpoint after each round."""
    source, _ = single_run("rounds=2", "checkpoint_every=1")
    run = tmp_path / "run"
    shutil.copytree(source, run)
    return run


def _resume_args(run: Path, cache_dir: Path, *extra: str) -> list[str]:
    return ["--config", str(SMOKE), "--out", str(run), f"data.cache_dir={cache_dir}", *extra]


@pytest.mark.launch
@pytest.mark.parametrize("extra,needles", [
    pytest.param([], ["already holds a run", "--resume auto"], id="same-out-without-resume"),
    pytest.param(["--resume", "auto", "rounds=1"], ["after round 2 but rounds=1", "pass rounds=2 or more"],
                 id="fewer-rounds-than-checkpointed"),
    pytest.param(["--resume", "auto", "rounds=2", "seed=7"], ["belongs to another experiment", "seed: 0 -> 7"],
                 id="another-experiment"),
])
def test_run_directory_mistakes(finished_run, capsys, cache_dir, extra, needles):
    _refused(capsys, _resume_args(finished_run, cache_dir, *extra), finished_run, 2, needles)


@pytest.mark.launch
def test_resume_with_emptied_metrics(finished_run, capsys, cache_dir):
    (finished_run / "metrics.jsonl").write_text("")
    _refused(capsys, _resume_args(finished_run, cache_dir, "--resume", "auto", "rounds=3"), finished_run, 2,
             ["cannot resume after round 2", "is empty", "rows of rounds 1-2"])


@pytest.mark.launch
def test_run_directory_in_use(finished_run, capsys, cache_dir):
    from test_nothing_lost import _hold_lock

    holder = _hold_lock(finished_run)
    try:
        _refused(capsys, _resume_args(finished_run, cache_dir, "--resume", "auto", "rounds=3"), finished_run, 2,
                 [f"is in use by pid {holder.pid}"])
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ a run directory the run could not write

HOLDER = '{"host": "node7", "pid": 4242, "started": "2026-01-01 00:00:00 UTC"}\n'
"""The lock file's record of an earlier run: a refused start leaves it as it was."""


def _occupied(run: Path, name: str, kind: str) -> Path:
    """``run`` with a ``kind`` ('directory' or 'file') where the run keeps ``name``, and a lock record."""
    target = run / name
    run.mkdir(exist_ok=True)
    if target.is_dir():
        shutil.rmtree(target)
    target.unlink(missing_ok=True)
    if kind == "directory":
        (target / "kept").mkdir(parents=True)
        (target / "kept" / "note.txt").write_text("the user's")
    else:
        target.write_text("the user's")
    (run / LOCK_FILE).write_text(HOLDER)
    return run


@pytest.mark.parametrize("name,kind,needle", [
    ("metrics.jsonl", "directory", "metrics.jsonl is a directory, not a regular file; the run keeps its metrics rows"),
    ("summary.json", "directory", "summary.json is a directory, not a regular file"),
    ("PREEMPTED", "directory", "PREEMPTED is a directory, not a regular file; the run keeps its preemption marker"),
    ("checkpoints", "file", "checkpoints is a regular file, not a directory; the run keeps its checkpoints"),
])
def test_run_directory_entry_of_the_wrong_kind(tmp_path, capsys, cache_dir, name, kind, needle):
    """Found when rank 0 takes the directory, not rounds later at the first row or checkpoint (or at
    the end): one line, and nothing in the directory changed, the lock's record included."""
    run = _occupied(tmp_path / "run", name, kind)
    _refused(capsys, _resume_args(run, cache_dir, "checkpoint_every=1"), run, 2,
             [f"run directory {run}: {needle}", "move it away, or pass a new --out"])
    assert (run / LOCK_FILE).read_text() == HOLDER


def test_a_start_refused_for_an_entry_of_the_wrong_kind_makes_no_lock_file(tmp_path, capsys, cache_dir):
    """A directory that holds no run yet (no lock file) and a metrics.jsonl that is a directory: was
    refused after the lock was taken, leaving a new empty lock file behind; now refused before."""
    run = tmp_path / "run"
    (run / "metrics.jsonl").mkdir(parents=True)
    _refused(capsys, _resume_args(run, cache_dir), run, 2,
             [f"run directory {run}: metrics.jsonl is a directory, not a regular file"])
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_resume_into_metrics_replaced_by_a_directory(finished_run, capsys, cache_dir):
    """Was an IsADirectoryError traceback, the lock file's record rewritten."""
    run = _occupied(finished_run, "metrics.jsonl", "directory")
    _refused(capsys, _resume_args(run, cache_dir, "--resume", "auto", "rounds=3"), run, 2,
             [f"run directory {run}: metrics.jsonl is a directory, not a regular file"])
    assert (run / LOCK_FILE).read_text() == HOLDER


def _writable_despite_mode(directory: Path) -> bool:
    """Whether this process writes into ``directory`` whatever its mode says (root, with
    CAP_DAC_OVERRIDE): chmod cannot make a directory read-only for it."""
    probe = directory / ".probe"
    try:
        probe.write_text("")
    except PermissionError:
        return False
    probe.unlink()
    return True


def test_read_only_checkpoints_directory(finished_run, capsys, cache_dir):
    """Was a PermissionError traceback at the first checkpoint, after the round's row was written.
    Root (os.geteuid() 0) writes there anyway: tests/runtime/test_checkpoints.py plays the OS's
    refusal instead, and this runs under ``capsh --drop=cap_dac_override``."""
    checkpoints = finished_run / "checkpoints"
    checkpoints.chmod(0o555)
    try:
        if _writable_despite_mode(checkpoints):
            pytest.skip(f"euid {os.geteuid()} writes into a read-only directory")
        _refused(capsys, _resume_args(finished_run, cache_dir, "--resume", "auto", "rounds=3", "checkpoint_every=1"),
                 finished_run, 2, [f"cannot create a file in {checkpoints}: Permission denied (EACCES)",
                                   "make it writable"])
    finally:
        checkpoints.chmod(0o755)


@pytest.mark.integration
def test_checkpoint_blocked_mid_run_is_one_line(tmp_path, capsys, cache_dir):
    """What the start cannot see (here a file where round 1's checkpoint directory goes) still ends
    the run with one line naming path, operation and errno, and the lock's record put back."""
    run = _occupied(tmp_path / "run", "checkpoints", "directory")
    (run / "checkpoints" / "round_00001").write_text("the user's")
    assert main(_resume_args(run, cache_dir, "rounds=1", "checkpoint_every=1")) == 2
    line = _stderr_line(capsys)
    assert line.endswith(f"cannot create the checkpoint directory {run / 'checkpoints' / 'round_00001'}: "
                         f"File exists (EEXIST)"), line
    assert (run / "checkpoints" / "round_00001").read_text() == "the user's"
    assert (run / LOCK_FILE).read_text() == HOLDER


def test_vocab_size_is_held_to_the_cap_the_datas_own_ids_are():
    """The config's bound and the PFLlib reader's cap are one number (the config layer may not import
    the data layer, so each states it)."""
    from htfl_dist.config.schema import DataConfig
    from htfl_dist.data.pfllib import MAX_VOCAB_SIZE

    bound = next(f for f in dataclasses.fields(DataConfig) if f.name == "vocab_size").metadata["bound"]
    assert bound.at_most == MAX_VOCAB_SIZE


# ------------------------------------------------------------------ no floods


@pytest.mark.integration
def test_a_diverged_run_says_one_warning_per_round_then_one_error(tmp_path, capsys, cache_dir):
    """train.lr=1e30: every upload is NaN. Was 18 warning lines (one per client per round) before
    the error; now one per round names all six clients, and the row keeps them one by one."""
    out = tmp_path / "run"
    assert main(["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}", "train.lr=1e30"]) == 1
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert "Traceback" not in captured.err
    assert lines[:-1] == [f"htfl_dist: warning: round {r}: left client 0 out: client 0 sent NaN/Inf values in "
                          f"'protos': its local training diverged (lower train.lr or algo.reg_weight); likewise "
                          f"clients 1-5" for r in (1, 2, 3)], captured.err
    assert lines[-1].startswith("htfl_dist: error: training diverged: every participating client's loss"), lines[-1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["skipped_clients"] for row in rows] == [list(range(6))] * 3


@pytest.mark.integration
def test_a_run_in_which_no_upload_ever_arrives_says_so_and_fails(tmp_path, capsys, cache_dir):
    """participation.drop_rate=0.99 (seed 0 drops all six uploads of both rounds): was test accuracy 0 %,
    exit 0 and not a word. Now one warning per round that aggregated nothing, then one line, status 1;
    the metrics and summary of what ran are kept."""
    out = tmp_path / "run"
    assert main(["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}", "rounds=2",
                 "participation.drop_rate=0.99"]) == 1
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert "Traceback" not in captured.err and "done:" not in captured.out
    assert lines[:-1] == [f"htfl_dist: warning: round {r}: the server aggregated nothing (0 of 6 uploads arrived; "
                          f"6 dropped (participation.drop_rate=0.99)); it keeps last round's knowledge" for r in (1, 2)]
    assert lines[-1].startswith("htfl_dist: error: no round of this run aggregated an upload (2 played"), lines[-1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["dropped_clients"] for row in rows] == [list(range(6))] * 2
    assert all(row["server_skipped"] for row in rows) and (out / "summary.json").exists()


# ------------------------------------------------------------------ --check: a start's checks in one process

def _check(argv: list[str]) -> list[str]:
    return ["--check", *argv]


@pytest.mark.parametrize("extra,needles", [
    pytest.param(["rounds=abc"], ["config key 'rounds' must be an integer, got 'abc'"], id="config-mistake"),
    pytest.param(["--world-size", "8"], ["8 ranks give 7 client ranks but there are only 6 logical clients"],
                 id="too-many-ranks"),
    pytest.param(["--world-size", "0"], ["--world-size 0: at least 1"], id="no-ranks"),
    pytest.param(["privacy.enabled=true", "privacy.target_epsilon=0.0001"],
                 ["privacy.target_epsilon=0.0001 cannot be reached"], id="unreachable-budget"),
])
def test_check_refuses_what_a_start_would_refuse_and_writes_nothing(tmp_path, capsys, extra, needles):
    """``--check`` is what the launch scripts run in one process before any rank starts."""
    out = tmp_path / "run"
    _refused(capsys, _check(["--config", str(SMOKE), "--out", str(out), *extra]), out, 2, needles)


def test_check_refuses_nccl_where_a_start_would_find_no_gpu(tmp_path, capsys):
    """The launch scripts run --check on the node the ranks start on: NCCL across ranks needs a GPU
    each, which was found only after torchrun had started them (its traceback after our line). A
    single rank talks to nobody, so it starts with any backend."""
    import torch

    out = tmp_path / "run"
    nccl = ["--check", *SMOKE_ARGS, "--out", str(out), "runtime.backend=nccl", "--world-size", "2"]
    _refused(capsys, [*nccl, "runtime.device=cpu"], out, 2,
             ["runtime.backend=nccl needs one GPU per rank, but runtime.device=cpu; use runtime.backend=gloo"])
    if torch.cuda.device_count() == 0:
        _refused(capsys, nccl, out, 2, ["runtime.backend=nccl needs one GPU per rank, but this machine has no GPU"])
    assert main(["--check", *SMOKE_ARGS, "--out", str(out), "runtime.backend=nccl", "runtime.device=cpu"]) == 0
    assert "ready to start" in capsys.readouterr().out


@pytest.mark.parametrize("out", ["/proc/htfl-no-such/run", "/proc/self", "/sys/kernel/run"])
def test_check_refuses_an_out_where_nothing_can_be_written(tmp_path, capsys, out):
    """/proc and /sys pass the mode bits for root, and --check said 'ready to start': the start then
    failed under torchrun. Now --check writes a byte there (and removes it), as a start would."""
    _refused(capsys, ["--check", *SMOKE_ARGS, "--out", out], tmp_path, 2,
             [f"cannot write the run directory {Path(out).resolve()} ("])


def test_world_size_belongs_to_check(tmp_path, capsys):
    out = tmp_path / "run"
    _refused(capsys, ["--config", str(SMOKE), "--out", str(out), "--world-size", "3"], out, 2,
             ["--world-size 3: only with --check"])


@pytest.mark.parametrize("name,kind,needle", [
    ("summary.json", "directory", "summary.json is a directory, not a regular file"),
    ("checkpoints", "file", "checkpoints is a regular file, not a directory"),
])
def test_check_refuses_a_run_directory_entry_of_the_wrong_kind(tmp_path, capsys, name, kind, needle):
    run = _occupied(tmp_path / "run", name, kind)
    _refused(capsys, _check(["--config", str(SMOKE), "--out", str(run)]), run, 2, [f"run directory {run}: {needle}"])
    assert (run / LOCK_FILE).read_text() == HOLDER


def test_check_refuses_an_out_that_cannot_be_a_directory(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("the user's")
    for out, reason in ((afile, "File exists"), (afile / "run", "Not a directory")):
        _refused(capsys, _check(["--config", str(SMOKE), "--out", str(out)]), tmp_path, 2,
                 [f"cannot write the run directory {out} ({reason})"])


def test_check_refuses_another_runs_directory_and_takes_a_resume_of_it(finished_run, capsys):
    _refused(capsys, _check(["--config", str(SMOKE), "--out", str(finished_run), "rounds=3"]), finished_run, 2,
             ["already holds a run", "--resume auto"])
    before = _snapshot(finished_run)
    assert main(_check(["--config", str(SMOKE), "--out", str(finished_run), "--resume", "auto", "rounds=3",
                        "--world-size", "3"])) == 0
    out = capsys.readouterr()
    assert out.err == "" and out.out == (f"check: fedproto, 6 clients, 3 rounds on 3 ranks; run directory "
                                         f"{finished_run}: ready to start\n")
    assert _snapshot(finished_run) == before


def test_check_of_a_good_start_creates_nothing(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    assert main(_check(["--config", str(SMOKE), "--out", str(out)])) == 0
    assert "ready to start" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()


@pytest.mark.launch
def test_check_refuses_a_directory_in_use(tmp_path, capsys):
    from test_nothing_lost import _hold_lock

    run = tmp_path / "run"
    run.mkdir()
    holder = _hold_lock(run)
    try:
        _refused(capsys, _check(["--config", str(SMOKE), "--out", str(run)]), run, 2,
                 [f"is in use by pid {holder.pid}"])
    finally:
        holder.kill()
        holder.wait()


def test_cuda_graphs_on_where_they_cannot_be_is_one_line_before_the_run_directory(tmp_path, capsys, cache_dir):
    out = tmp_path / "run"
    line = _refused(capsys, [*SMOKE_ARGS, "--out", str(out), f"data.cache_dir={cache_dir}", "runtime.device=cpu",
                             "train.cuda_graphs=on"], out, 2, [
        "train.cuda_graphs=on cannot record the local steps: the device is cpu, not a CUDA GPU; "
        "use train.cuda_graphs=auto or off"])
    assert line.startswith("htfl_dist: error: ")
