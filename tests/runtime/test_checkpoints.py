"""Checkpoints: keep-k, resume from a path, refusal of another experiment, corrupt files."""
from __future__ import annotations

import os

import pytest

from conftest import SMOKE, launch, read_metrics, run_program


def _args(out, cache_dir, *overrides):
    return ["--config", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}", *overrides]


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, cache_dir):
    """A 3-round run that checkpoints every round and keeps the last two."""
    out = tmp_path_factory.mktemp("ckpt")
    result = run_program(_args(out, cache_dir, "checkpoint_every=1", "checkpoint_keep=2"))
    assert result.returncode == 0, result.stderr
    return out


def test_keeps_the_newest_k_complete_checkpoints(checkpointed):
    kept = sorted(p.name for p in (checkpointed / "checkpoints").iterdir())
    assert kept == ["round_00002", "round_00003"]
    assert (checkpointed / "checkpoints" / "round_00003" / "MANIFEST.json").is_file()
    files = sorted(p.name for p in (checkpointed / "checkpoints" / "round_00003").iterdir())
    assert files == sorted(["MANIFEST.json", "server.pt"] + [f"client_{i}.pt" for i in range(6)])


@pytest.mark.launch
def test_resume_from_a_checkpoint_path_into_a_new_run(checkpointed, tmp_path, cache_dir):
    """Round 2's checkpoint, resumed elsewhere on 2 ranks, reproduces round 3 exactly."""
    source = checkpointed / "checkpoints" / "round_00002"
    result = launch("torchrun", 2, [*_args(tmp_path, cache_dir), "--resume", str(source)])
    assert result.returncode == 0, result.stderr
    assert [r["test_acc"] for r in read_metrics(tmp_path)] == [r["test_acc"] for r in read_metrics(checkpointed)]


@pytest.mark.integration
def test_resume_of_another_experiment_is_refused(checkpointed, tmp_path, cache_dir):
    args = _args(tmp_path, cache_dir, "seed=1", "data.partition=pathological")
    result = run_program([*args, "--resume", str(checkpointed)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "another experiment" in lines[0]
    assert "seed: 0 -> 1" in lines[0] and "data.partition: 'dirichlet' -> 'pathological'" in lines[0]


@pytest.mark.integration
def test_corrupt_checkpoint_is_one_line_and_damages_nothing(checkpointed, tmp_path, cache_dir):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(checkpointed, copy)
    victim = copy / "checkpoints" / "round_00003" / "client_4.pt"
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    result = run_program([*_args(copy, cache_dir, "rounds=4"), "--resume", "auto"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "client_4.pt cannot be read" in lines[0] and "Traceback" not in result.stderr
    after = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    assert after == before  # config.yaml included: it is only written once the resume is accepted


def _copy_run(source, destination):
    import shutil

    shutil.copytree(source, destination)
    return destination


@pytest.mark.integration
def test_resume_auto_without_a_checkpoint_starts_over(checkpointed, tmp_path, cache_dir):
    """A run that died before its first checkpoint: --resume auto starts fresh and its rows
    replace the dead run's (even a half-written last line), instead of being appended to them."""
    copy = _copy_run(checkpointed, tmp_path / "run")
    import shutil

    shutil.rmtree(copy / "checkpoints")
    (copy / "summary.json").unlink()
    with open(copy / "metrics.jsonl", "a") as handle:
        handle.write('{"round": 4, "test_a')  # killed mid-append
    result = run_program([*_args(copy, cache_dir), "--resume", "auto"])
    assert result.returncode == 0, result.stderr
    rows = read_metrics(copy)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["test_acc"] for r in rows] == [r["test_acc"] for r in read_metrics(checkpointed)]


@pytest.mark.integration
def test_resume_past_the_planned_rounds_is_refused(checkpointed, tmp_path, cache_dir):
    copy = _copy_run(checkpointed, tmp_path / "run")
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    result = run_program([*_args(copy, cache_dir, "rounds=2"), "--resume", "auto"])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is after round 3 but rounds=2; pass rounds=3 or more" in lines[0], result.stderr
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_resume_from_elsewhere_never_overwrites_an_existing_run(checkpointed, tmp_path, cache_dir):
    copy = _copy_run(checkpointed, tmp_path / "run")
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    other = checkpointed / "checkpoints" / "round_00002"
    result = run_program([*_args(copy, cache_dir), "--resume", str(other)])
    assert result.returncode == 2
    assert "already holds a run" in result.stderr and "Traceback" not in result.stderr
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


@pytest.mark.integration
def test_extending_a_finished_run_rewrites_its_summary(checkpointed, tmp_path, cache_dir):
    import json

    copy = _copy_run(checkpointed, tmp_path / "run")
    result = run_program([*_args(copy, cache_dir, "rounds=4"), "--resume", "auto"])
    assert result.returncode == 0, result.stderr
    assert [r["round"] for r in read_metrics(copy)] == [1, 2, 3, 4]
    assert json.loads((copy / "summary.json").read_text())["rounds"] == 4


def test_unwritable_output_directory(tmp_path, cache_dir):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_program(_args(blocker / "run", cache_dir))
    assert result.returncode == 2
    assert "cannot write the run directory" in result.stderr and "Traceback" not in result.stderr


def test_prune_drops_old_and_incomplete_checkpoints(tmp_path):
    from htfl_dist.runtime.checkpoint import _prune

    root = tmp_path / "checkpoints"
    for round_number, complete in [(1, True), (2, False), (3, True), (4, True), (5, False)]:
        directory = root / f"round_{round_number:05d}"
        directory.mkdir(parents=True)
        if complete:
            (directory / "MANIFEST.json").write_text("{}")
    _prune(tmp_path, keep=2)
    # round 5 is incomplete but newer than the newest complete one: a save may be under way
    assert sorted(p.name for p in root.iterdir()) == ["round_00003", "round_00004", "round_00005"]


def test_an_unfinished_save_between_two_complete_checkpoints_is_dropped(tmp_path):
    """Rounds 1, 3, 5 complete, 4 cut short: 4 is older than the newest complete one (5), so no
    save can still be writing it."""
    from htfl_dist.runtime.checkpoint import _prune

    root = tmp_path / "checkpoints"
    for round_number in (1, 3, 4, 5):
        (root / f"round_{round_number:05d}").mkdir(parents=True)
        if round_number != 4:
            (root / f"round_{round_number:05d}" / "MANIFEST.json").write_text("{}")
    _prune(tmp_path, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["round_00003", "round_00005"]


def test_only_round_directories_count_as_checkpoints(tmp_path):
    from htfl_dist.runtime.checkpoint import _checkpoint_dirs

    root = tmp_path / "checkpoints"
    (root / "round_00002").mkdir(parents=True)
    (root / "round_old").mkdir()
    (root / "round_00007").write_text("a file a tool left, named like a checkpoint")
    assert _checkpoint_dirs(tmp_path) == [(2, root / "round_00002")]


def test_manifests_of_older_versions_still_match_their_experiment():
    """Older manifests kept data paths in the experiment and algo.* as typed; they still resume,
    and a real change is still named."""
    from htfl_dist.algorithms import spelled_out_options
    from htfl_dist.config import load_config
    from htfl_dist.runtime.checkpoint import _changes_since

    config = load_config(SMOKE, ["algorithm=fedtgp", "algo.tau=50"])
    config.algo = spelled_out_options("fedtgp", config.algo)  # as main does
    old = config.experiment()
    old["data"].update(root="/old/data", cache_dir="/old/cache")
    old["algo"] = {"tau": 50.0}
    assert _changes_since({"experiment": old}, config) == []
    old["seed"] = 7
    assert _changes_since({"experiment": old}, config) == ["seed: 7 -> 0"]


@pytest.mark.integration
def test_foreign_directories_among_checkpoints_are_ignored_and_kept(checkpointed, tmp_path, cache_dir):
    """A user's backup copy (round_00003.bak) and a stray round_old are not checkpoints: resume
    uses the real newest one, and saving and pruning leave them alone."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(checkpointed, copy)
    root = copy / "checkpoints"
    shutil.copytree(root / "round_00003", root / "round_00003.bak")
    (root / "round_old").mkdir()
    result = run_program([*_args(copy, cache_dir, "rounds=4", "checkpoint_every=1", "checkpoint_keep=2"),
                         "--resume", "auto"])
    assert result.returncode == 0, result.stderr
    assert "continuing after round 3" in result.stdout + result.stderr
    assert sorted(p.name for p in root.iterdir()) == ["round_00003", "round_00003.bak", "round_00004", "round_old"]


@pytest.mark.integration
def test_manifest_that_is_not_a_mapping_is_one_line(checkpointed, tmp_path, cache_dir):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(checkpointed, copy)
    (copy / "checkpoints" / "round_00003" / "MANIFEST.json").write_text("[1, 2]")
    result = run_program([*_args(copy, cache_dir, "rounds=4"), "--resume", "auto"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "MANIFEST.json is unreadable" in lines[0]


FMNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                "t10k-labels-idx1-ubyte.gz")


def _fmnist_copy(directory, shuffle_training_labels: bool):
    """Fashion-MNIST's four IDX files copied (times kept: a moved dataset), or with the training
    labels shuffled (the same sizes, another file)."""
    import gzip
    import shutil

    import numpy as np

    from htfl_dist.config import DEFAULT_FMNIST_ROOT

    directory.mkdir()
    for name in FMNIST_FILES:
        shutil.copy2(f"{DEFAULT_FMNIST_ROOT}/{name}", directory / name)
    if shuffle_training_labels:
        path = directory / "train-labels-idx1-ubyte.gz"
        raw = bytearray(gzip.decompress(path.read_bytes()))
        labels = np.frombuffer(bytes(raw[8:]), dtype=np.uint8).copy()
        np.random.default_rng(0).shuffle(labels)
        raw[8:] = labels.tobytes()
        path.write_bytes(gzip.compress(bytes(raw)))
    return directory


@pytest.mark.integration
def test_a_resume_on_other_data_is_refused_unless_allowed(checkpointed, tmp_path, cache_dir):
    """The checkpoint keeps what its clients trained on. Resumed with data.root at a copy of
    Fashion-MNIST whose training labels were shuffled, the run is refused in one line naming the
    change; with data.allow_changed=true it goes on and summary.json says so; a moved copy of the
    same files is the same data."""
    import json
    import shutil

    source = checkpointed / "checkpoints" / "round_00003"
    moved = _fmnist_copy(tmp_path / "moved", shuffle_training_labels=False)
    same = _args(tmp_path / "same", cache_dir, f"data.root={moved}", "rounds=4")
    result = run_program([*same, "--resume", str(source)])
    assert result.returncode == 0, result.stderr
    shuffled = _fmnist_copy(tmp_path / "shuffled", shuffle_training_labels=True)
    args = _args(tmp_path / "other", cache_dir, f"data.root={shuffled}", "rounds=4")
    refused = run_program([*args, "--resume", str(source)])
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "was trained on other data (fmnist-dirichlet-" in lines[0]
    assert "data.allow_changed=true" in lines[0] and not (tmp_path / "other" / "metrics.jsonl").exists()
    shutil.rmtree(tmp_path / "other")
    allowed = run_program([*args, "data.allow_changed=true", "--resume", str(source)])
    assert allowed.returncode == 0, allowed.stderr
    summary = json.loads((tmp_path / "other" / "summary.json").read_text())
    assert summary["data_changed_on_resume"]["after_round"] == 3
    assert summary["data_changed_on_resume"]["data"].startswith("fmnist-dirichlet-")
    assert "going on with these (data.allow_changed=true)" in allowed.stdout


# ------------------------------------------------------------------ a run directory that cannot take checkpoints


def test_a_checkpoint_that_cannot_be_created_is_one_line(tmp_path):
    """Found rounds into a run (the up-front check cannot see round directories): one line naming
    the directory, the operation and errno, not a NotADirectoryError traceback."""
    from htfl_dist.atomic import OutputError
    from htfl_dist.runtime.checkpoint import _save_own_files

    (tmp_path / "checkpoints").write_text("a file where the checkpoints belong")
    directory = tmp_path / "checkpoints" / "round_00001"
    with pytest.raises(OutputError) as info:
        _save_own_files(directory, [], None)  # type: ignore[arg-type]
    assert str(info.value) == f"cannot create the checkpoint directory {directory}: Not a directory (ENOTDIR)"


def test_a_checkpoints_directory_the_run_cannot_write_is_refused_up_front(tmp_path, monkeypatch):
    """chmod cannot make a directory unwritable for root, so the OS's refusal is played: the
    check's probe file gets EACCES, as a read-only ``checkpoints/`` gives it to other users."""
    import errno
    import tempfile

    from htfl_dist.atomic import OutputError
    from htfl_dist.runtime.bootstrap import check_run_directory

    (tmp_path / "checkpoints").mkdir()
    check_run_directory(tmp_path)  # writable: accepted, and the probe is gone again
    assert list((tmp_path / "checkpoints").iterdir()) == []

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(OutputError) as info:
        check_run_directory(tmp_path)
    assert str(info.value) == (f"cannot create a file in {tmp_path / 'checkpoints'}: Permission denied (EACCES); "
                               f"make it writable (the run keeps its checkpoints there), or pass a new --out")


@pytest.mark.parametrize(("name", "make", "kind", "wanted"), [
    ("checkpoints", lambda path: path.write_text("x"), "regular file", "directory"),
    ("metrics.jsonl", lambda path: path.mkdir(), "directory", "regular file"),
    ("summary.json", lambda path: os.mkfifo(path), "named pipe", "regular file"),  # reading it would block
    ("config.yaml", lambda path: path.symlink_to(path.parent / "elsewhere", target_is_directory=True) or
     (path.parent / "elsewhere").mkdir(), "directory", "regular file"),  # links are followed
])
def test_run_directory_entries_of_the_wrong_kind_are_refused(tmp_path, name, make, kind, wanted):
    from htfl_dist.errors import HtflError
    from htfl_dist.runtime.bootstrap import check_run_directory

    make(tmp_path / name)
    with pytest.raises(HtflError) as info:
        check_run_directory(tmp_path)
    assert str(info.value).startswith(f"run directory {tmp_path}: {name} is a {kind}, not a {wanted}; the run keeps ")
    assert str(info.value).endswith("there: move it away, or pass a new --out")
