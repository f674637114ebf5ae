"""Bad input through a real launch: the few cases only a process shows (argparse in a fresh
interpreter, torchrun's failure summary, mpirun's world). The catalogue of every bad input, run
in-process, is tests/e2e/test_bad_inputs.py."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import BIN, REPO, SMOKE, _env, launch, run_program


def _assert_one_line(result, *needles) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_config_key_written_as_an_option_says_how_to_write_it(tmp_path):
    result = run_program(["--config", str(SMOKE), "--out", str(tmp_path / "run"), "--rounds", "3"])
    assert result.returncode == 2
    line = _assert_one_line(result, "htfl_dist: error: unrecognized arguments: --rounds")
    assert line.endswith("write rounds=VALUE (python -m htfl_dist.main --help lists the options)"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.launch
def test_alias_bomb_config_is_refused_at_once(tmp_path):
    """Nine levels of ten aliases: before, building the error line's repr ran out of memory."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    config = tmp_path / "bomb.yaml"
    config.write_text("\n".join(lines) + "\ndata:\n  root: *a8\n")
    result = launch("single", 1, ["--config", str(config), "--out", str(tmp_path / "run")], timeout=60)
    assert result.returncode == 2
    _assert_one_line(result, "bomb.yaml", "aliases expand to more than")


@pytest.mark.launch
def test_torchrun_failure_summary_shows_our_line(tmp_path):
    """torchrun prints its own ChildFailedError summary after our line; the per-rank error file
    we write makes that summary name the reason instead of pointing at a docs page."""
    result = launch("torchrun", 2, ["--config", str(SMOKE), "--out", str(tmp_path / "run"), "rounds=abc"],
                    timeout=120)
    assert result.returncode != 0
    root_cause = result.stderr.split("Root Cause", 1)[-1]
    assert "traceback : htfl_dist: error: config key 'rounds' must be an integer" in root_cause, result.stderr
    assert "To enable traceback see" not in result.stderr


@pytest.mark.launch
def test_more_client_ranks_than_clients(tmp_path):
    result = launch("mpirun", 4, ["--config", str(SMOKE), "--out", str(tmp_path / "run"), "num_clients=2"],
                    timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.count("3 client ranks but there are only 2 logical clients") == 1


def test_feature_width_mismatch_is_refused():
    import torch

    from htfl_dist.errors import HtflError
    from htfl_dist.models import build_model
    from htfl_dist.runtime.startup import check_feature_width

    model = build_model("htcnn1", num_classes=10, feature_dim=256, in_channels=1, image_size=28)
    with pytest.raises(HtflError, match=r"client 3's htcnn1 gives features of shape \(256,\).*model.feature_dim=512"):
        check_feature_width(model, "htcnn1", 3, torch.zeros(2, 1, 28, 28), 512)


# ------------------------------------------------------------------ the launch scripts check before any rank starts

def _script(command: list[str], extra_env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(command, cwd=REPO, env={**_env(), **(extra_env or {})}, capture_output=True,
                          text=True, timeout=timeout)


FAKE_SLURM = {"SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_ON_NODE": "2", "SLURM_NTASKS_PER_NODE": "2",
              "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]"}
"""What a batch script reads of its allocation; the check comes before the first SLURM command."""


@pytest.mark.launch
@pytest.mark.parametrize("command,env", [
    pytest.param(["launch/local_cpu.sh", "3"], {}, id="local_cpu.sh"),
    pytest.param(["launch/gpu_node.sh"], {"NPROC": "3"}, id="gpu_node.sh"),
    pytest.param(["launch/mpi.sh", "3"], {}, id="mpi.sh"),
    pytest.param(["bash", "slurm/cpu.sbatch"], FAKE_SLURM, id="cpu.sbatch"),
    pytest.param(["bash", "slurm/gpu.sbatch"], FAKE_SLURM, id="gpu.sbatch"),
])
def test_a_launch_scripts_config_mistake_is_one_line_before_any_rank(tmp_path, command, env):
    """Was our line, then torchrun's ChildFailedError traceback and summary (40-90 lines) and exit
    status 1; under mpirun the line alone, but after starting every rank: the scripts run
    ``--check`` in one process first (exit 2), and no launcher is called."""
    out = tmp_path / "run"
    called = tmp_path / "launchers-called"
    path = f"{_recording_launchers(tmp_path / 'shims', called)}:{_env()['PATH']}"
    result = _script([*command, str(SMOKE), "--out", str(out), "rounds=abc"], {**env, "PATH": path})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert _assert_one_line(result) == "htfl_dist: error: config key 'rounds' must be an integer, got 'abc'"
    assert not called.exists(), called.read_text()
    assert not out.exists()


def _recording_launchers(shims: Path, called: Path) -> Path:
    """torchrun, mpirun, srun and scontrol that write their name to ``called`` first (the first two
    then run the real one)."""
    shims.mkdir()
    for name in ("torchrun", "mpirun", "srun", "scontrol"):
        real = BIN / name
        then = f'exec "{real}" "$@"' if real.exists() else "exit 1"
        (shims / name).write_text(f'#!/bin/sh\necho {name} >> "{called}"\n{then}\n')
        (shims / name).chmod(0o755)
    return shims


@pytest.mark.launch
def test_a_launch_script_with_a_good_config_starts_its_ranks(tmp_path, cache_dir):
    """The check takes the arguments the ranks take (an override, --out), then torchrun runs."""
    out = tmp_path / "run"
    result = _script(["launch/local_cpu.sh", "3", str(SMOKE), "--out", str(out), f"data.cache_dir={cache_dir}",
                      "rounds=1"], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "done: best test_acc" in result.stdout and "ready to start" not in result.stdout
    assert (out / "summary.json").is_file()


# ------------------------------------------------------------------ the study's --out

@pytest.mark.parametrize("where,mode,needle", [
    pytest.param("afile", [], "is a regular file; the study keeps its cells in a directory there: pass a new --out",
                 id="an-existing-file"),
    pytest.param("afile", ["--dry-run"], "is a regular file", id="an-existing-file-dry-run"),
    pytest.param("afile/study", [], "lies under {tmp}/afile, which is a regular file", id="under-a-file"),
    pytest.param("afile/study", ["--dry-run"], "lies under {tmp}/afile", id="under-a-file-dry-run"),
    pytest.param("/proc/htfl-no-such/study", [], "cannot write the study directory /proc/htfl-no-such/study "
                                                 "(No such file or directory)", id="uncreatable"),
])
def test_a_study_out_that_cannot_be_its_directory_is_one_line(tmp_path, capsys, where, mode, needle):
    """Was a FileExistsError / FileNotFoundError traceback (issue 40), then mkdir's bare 'File exists'."""
    from htfl_dist.study.__main__ import main as study_main

    (tmp_path / "afile").write_text("the user's")
    study = tmp_path / "study.yaml"
    study.write_text(f"title: t\nbase: {SMOKE}\ngrid:\n  algorithm: [fedproto]\n")
    assert study_main([str(study), "--out", where if where.startswith("/") else str(tmp_path / where), *mode]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("htfl_dist.study: error: "), err
    assert needle.format(tmp=tmp_path) in err, err
    assert (tmp_path / "afile").read_text() == "the user's"
