"""bench/side_by_side.py against a fake reference laid out as HtFLlib (CI cannot fetch the real
one): its refusals, the argv it maps each method to, its table's arithmetic, and one whole play on
tiny data, where the fake checks the split it is given and prints accuracies the test chose, and
ours is a real run whose rows the table must show."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, _env

spec = importlib.util.spec_from_file_location("side_by_side", REPO / "bench" / "side_by_side.py")
assert spec and spec.loader
side_by_side = importlib.util.module_from_spec(spec)
sys.modules["side_by_side"] = side_by_side
spec.loader.exec_module(side_by_side)

CHOSEN = {"reference_1": [0.1, 0.4125, 0.6], "reference_2": [0.1, 0.4, 0.625]}
"""The fake's evaluations per run (HtFLlib's first is of the untrained models, left out)."""

FAKE_MAIN = textwrap.dedent('''\
    import argparse, json, os
    import numpy as np
    FAMILIES = ["HCNNs8"]
    parser = argparse.ArgumentParser()
    for flag in ("-data", "-m", "-algo", "-dev"):
        parser.add_argument(flag)
    for flag in ("-gr", "-nc", "-ncl", "-lbs", "-ls", "-fd"):
        parser.add_argument(flag, type=int)
    for flag in ("-lr", "-jr", "-lam"):
        parser.add_argument(flag, type=float)
    args = parser.parse_args()
    assert args.m in FAMILIES, args.m
    for part in ("train", "test"):
        for client in range(args.nc):
            with open(f"../dataset/{args.data}/{part}/{client}.npz", "rb") as handle:
                data = np.load(handle, allow_pickle=True)["data"].tolist()
            x, y = data["x"], data["y"]
            assert x.dtype == np.float32 and x.shape[1:] == (1, 28, 28) and y.shape == (len(x),), (x.shape, y.shape)
    run = os.path.basename(os.path.dirname(os.getcwd()))
    with open("argv.json", "w") as handle:
        json.dump(__import__("sys").argv[1:], handle)
    for accuracy in %s[run][: args.gr + 1]:
        print(f"Averaged Test Accurancy: {accuracy:.4f}")
''') % json.dumps(CHOSEN)


def fake_reference(root, main: str = FAKE_MAIN):
    (root / "system").mkdir(parents=True)
    (root / "system" / "main.py").write_text(main)
    return root


def refusal(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        side_by_side.parse_args(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def test_refusals_name_what_is_wrong(tmp_path, capsys):
    ref = str(fake_reference(tmp_path / "ref"))
    out = ["--out", str(tmp_path / "out")]
    assert "unknown method 'fedfoo'" in refusal(capsys, ["fedfoo", "--reference", ref, *out])
    assert "fedhkd is not wired: own layout" in refusal(capsys, ["fedhkd", "--reference", ref, *out])
    assert "fedpcl is not wired: PFLlib's main.py" in refusal(capsys, ["fedpcl", "--reference", ref, *out])
    (tmp_path / "empty").mkdir()
    assert "has no system/main.py" in refusal(capsys, ["fedproto", "--reference", str(tmp_path / "empty"), *out])
    plain = str(fake_reference(tmp_path / "plain", "print('no family here')\n"))
    assert "has no HCNNs8 model family" in refusal(capsys, ["fedproto", "--reference", plain, *out])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "is not empty" in refusal(capsys, ["fedproto", "--reference", ref, "--out", str(tmp_path / "full")])
    assert "--rounds must be at least 1" in refusal(capsys, ["fedproto", "--reference", ref, *out, "--rounds", "0"])


def test_each_method_maps_to_its_references_flags(tmp_path):
    args = side_by_side.parse_args(["fedorgp", "--reference", str(fake_reference(tmp_path / "ref")),
                                    "--out", str(tmp_path / "out"), "--clients", "7", "--rounds", "4"])
    orgp = side_by_side.METHODS["fedorgp"]
    assert side_by_side.reference_argv(orgp, args) == [
        "-data", "Fashion", "-m", "HCNNs8", "-algo", "FedOrth", "-er", "4", "-nc", "7", "-nb", "10",
        "-lbs", "10", "-lr", "0.01", "-ls", "1", "-jr", "1", "-fd", "512", "-dev", "cpu",
        "-clam", "10", "-slam", "1", "-gam", "10", "-se", "1"]
    ours = side_by_side.our_argv(side_by_side.METHODS["fedkd"], args, tmp_path / "out")
    assert ours[ours.index("--config") + 1].endswith("configs/fmnist_htcnn8_fedkd_dirichlet.yaml")
    assert {"rounds=4", "num_clients=7", "algo.global_rounds=4", "model.init=htfllib", "data.partition=pfllib",
            f"data.pfllib_dir={tmp_path / 'out' / 'dataset' / 'FMNIST'}"} <= set(ours)
    for method in side_by_side.METHODS.values():  # every config named exists
        assert (REPO / "configs" / method.config).is_file(), method.config


def test_list_names_every_method_and_why_some_are_not_wired(capsys):
    assert side_by_side.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fedproto: -algo FedProto -lam 10  [TsingZ0/HtFLlib at 728e52a")
    assert "fedhkd: not wired: own layout" in lines and len(lines) == len(side_by_side.METHODS) + len(
        side_by_side.NOT_WIRED)


def test_table_gives_spread_and_difference_to_the_mean():
    rows = side_by_side.table_rows([0.5, 0.6], [[0.45, 0.7], [0.4]], rounds=3)
    assert [r["reference"] for r in rows] == [[45.0, 40.0], [70.0, None], [None, None]]
    assert [r["spread"] for r in rows] == [pytest.approx(5.0), 0.0, None]
    assert [r["ours_minus_mean"] for r in rows] == [pytest.approx(7.5), pytest.approx(-10.0), None]
    lines = side_by_side.markdown(rows, runs=2)
    assert lines[0] == "| round | ours | reference 1 | reference 2 | reference spread | ours − reference mean |"
    assert lines[2] == "| 1 | 50.00 | 45.00 | 40.00 | 5.00 | 7.50 |" and lines[4] == "| 3 | – | – | – | – | – |"
    assert side_by_side.cell(-1e-9) == "0.00" and side_by_side.cell(-0.006) == "-0.01"  # equal sides: no "-0.00"


def test_reference_logs_are_read_in_either_format():
    text = ("Averaged Test Accurancy: 0.1000\nStd Test Accurancy: 0.2\n"
            "[2026-11-27 04:33:01] Averaged Test Accuracy: 0.7557\n")  # FedORGP's file, spelt right
    assert side_by_side.log_accuracies(text) == [0.1, 0.7557]


@pytest.mark.launch
def test_play_against_a_fake_reference(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "side_by_side.py"), "fedproto", "--reference",
                           str(fake_reference(tmp_path / "ref")), "--out", str(out), "--clients", "3",
                           "--subsample", "0.02", "--rounds", "2", "--reference-runs", "2"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr + (out / "reference_1" / "output.log").read_text()
    result = json.loads((out / "side_by_side.json").read_text())
    rows = result["rounds"]
    assert [r["reference"] for r in rows] == [[41.25, 40.0], [60.0, 62.5]]
    assert [r["spread"] for r in rows] == [pytest.approx(1.25), pytest.approx(2.5)]
    metrics = [json.loads(line) for line in (out / "ours" / "metrics.jsonl").read_text().splitlines()]
    assert [r["ours"] for r in rows] == [pytest.approx(100 * m["test_acc"]) for m in metrics] and len(metrics) == 2
    assert rows[0]["ours_minus_mean"] == pytest.approx(rows[0]["ours"] - 40.625)
    for run in ("reference_1", "reference_2"):
        assert json.loads((out / run / "system" / "argv.json").read_text()) == [
            "-data", "FMNIST", "-m", "HCNNs8", "-algo", "FedProto", "-gr", "2", "-nc", "3", "-ncl", "10",
            "-lbs", "10", "-lr", "0.01", "-ls", "1", "-jr", "1", "-fd", "512", "-dev", "cpu", "-lam", "10"]
    table = (out / "side_by_side.md").read_text()
    assert "| 2 | " in table and "| 60.00 | 62.50 | 2.50 |" in table and "commit: unknown" in table
    assert "{run} = reference_1, reference_2)" in table
    assert "| 60.00 | 62.50 | 2.50 |" in done.stdout


FAKE_FEDORTH = textwrap.dedent('''\
    import os, sys
    FAMILIES = ["HCNNs8"]
    argv = sys.argv[1:]
    data, rounds = argv[argv.index("-data") + 1], int(argv[argv.index("-er") + 1])
    assert os.path.isfile(f"../dataset/{data}/train/0.npz"), data
    os.makedirs("temp/Fashion/FedOrth/1", exist_ok=True)
    with open("temp/Fashion/FedOrth/1/log.log", "w") as log:
        for accuracy in (0.7557, 0.8059, 0.8505)[:rounds]:
            log.write(f"[2026-11-29 04:51:40] Averaged Test Accuracy: {accuracy:.4f}\\n")
    print("Averaged Test AUC: 0.0000")
''')


@pytest.mark.launch
def test_a_reference_that_logs_to_a_file_and_evaluates_after_training(tmp_path):
    """FedORGP's layout: it reads the split as ``Fashion``, runs ``-er`` rounds, and writes each
    evaluation (after the round's training, so none is left out) to a log file of its own."""
    _env()  # a launch: the test must be marked so
    args = side_by_side.parse_args(["fedorgp", "--reference", str(fake_reference(tmp_path / "ref", FAKE_FEDORTH)),
                                    "--out", str(tmp_path / "out"), "--clients", "3", "--subsample", "0.02",
                                    "--rounds", "2"])
    out = (tmp_path / "out").resolve()
    out.mkdir()
    side_by_side.write_split(args, out)
    accuracies, rc = side_by_side.reference_run(side_by_side.METHODS["fedorgp"], args, out, 1)
    assert rc == 0, (out / "reference_1" / "output.log").read_text()
    assert accuracies == [0.7557, 0.8059]
