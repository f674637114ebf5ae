"""bench/fedrolex_side_by_side.py against a fake reference laid out as AIoT-MLSys-Lab/FedRolex (CI
cannot fetch the real one): its refusals, the settings and argv it maps our config to, the Ray and
CUDA stand-ins, and one whole play on tiny data. The fake's clients check the split the runner
hands them (the reference's structures) and report what they saw; its server ignores the uploads
and sets, after round r, a head whose masked argmax is the held class nearest (3 r) mod 10, so
the test knows each round's pooled sub-model accuracy from the split files alone; ours is a real
run whose rows the table must show."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import REPO, _env

spec = importlib.util.spec_from_file_location("fedrolex_side_by_side", REPO / "bench" / "fedrolex_side_by_side.py")
assert spec and spec.loader
rolex = importlib.util.module_from_spec(spec)
sys.modules["fedrolex_side_by_side"] = rolex
spec.loader.exec_module(rolex)

FAKE = {
    "config.yml": """\
        control: {fed: '1', num_users: '100', frac: '0.1', data_split_mode: iid, model_split_mode: fix,
                  model_mode: a1, norm: bn, scale: '1', mask: '1'}
        data_name: CIFAR10
        shuffle: {train: true, test: false}
        log_interval: 0.25
        """,
    "config.py": """\
        import yaml
        with open('config.yml') as f:
            cfg = yaml.safe_load(f)
        """,
    "utils.py": """\
        import torch
        from config import cfg

        def process_control():
            rates = {'a': 1, 'b': 0.5, 'c': 0.25, 'd': 0.125, 'e': 0.0625}
            users = int(cfg['control']['num_users'])
            cfg['global_model_rate'] = rates[cfg['control']['model_mode'][0]]
            cfg['model_rate'] = [rates['abcde'[5 * i // users]] for i in range(users)]  # contiguous blocks
            cfg['data_shape'] = [1, 28, 28] if cfg['data_name'] == 'MNIST' else [3, 32, 32]
            cfg['mask'] = cfg['control']['mask'] == '1'

        def make_optimizer(model, lr):
            return torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg['momentum'],
                                   weight_decay=cfg['weight_decay'])

        def make_scheduler(optimizer):
            return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg['milestones'], gamma=cfg['factor'])
        """,
    "models/__init__.py": "",
    "models/resnet.py": """\
        import math
        import torch
        import torch.nn.functional as F
        from torch import nn

        class Tiny(nn.Module):
            def __init__(self, rate, cfg):
                super().__init__()
                self.cfg = cfg
                self.linear = nn.Linear(math.ceil(4 * rate), cfg['classes_size'])

            def forward(self, input):
                out = self.linear.bias.expand(len(input['img']), -1)
                if 'label_split' in input and self.cfg['mask']:
                    mask = torch.zeros(self.cfg['classes_size'], device=out.device)
                    mask[input['label_split']] = 1
                    out = out.masked_fill(mask == 0, 0)
                return {'score': out, 'loss': F.cross_entropy(out, input['label'])}

        def resnet18(model_rate=1, track=False, cfg=None):
            assert cfg['data_shape'] == [1, 28, 28], cfg['data_shape']
            return Tiny(model_rate, cfg)
        """,
    "resnet_client.py": """\
        import anytree  # noqa: F401  (the official client imports it through its dataset files)
        import ray
        import torch
        from tqdm import tqdm
        from models import resnet

        @ray.remote(num_gpus=0.15)
        class ResnetClient:
            def __init__(self, log_path, cfg):
                self.cfg = ray.get(cfg[0])

            def update(self, client_id, dataset_ref, model_ref):
                self.client_id, self.rate, self.lr = client_id, model_ref['model_rate'], model_ref['lr']
                self.dataset, self.split = ray.get(dataset_ref['dataset']), ray.get(dataset_ref['split'])
                self.label_split = ray.get(dataset_ref['label_split'])[client_id]
                self.params = ray.get(model_ref['local_params'])

            def step(self, m, num_active_users, start_time):
                model = resnet.resnet18(model_rate=self.rate, cfg=self.cfg).to('cuda')
                model.load_state_dict(self.params)
                seen, label_sum, batches = 0, 0, 0
                for _ in tqdm(range(self.cfg['num_epochs']['local'])):
                    for start in range(0, len(self.split[self.client_id]), self.cfg['batch_size']['train']):
                        mine = self.split[self.client_id][start:start + self.cfg['batch_size']['train']]
                        items = [self.dataset[i] for i in mine]
                        img = torch.stack([item['img'] for item in items]).to('cuda')
                        label = torch.tensor([item['label'] for item in items])
                        assert img.dtype == torch.float32 and img.shape[1:] == (1, 28, 28), img.shape
                        assert set(label.tolist()) <= set(self.label_split), (label, self.label_split)
                        seen, label_sum, batches = seen + len(label), label_sum + int(label.sum()), batches + 1
                return {'state': model.state_dict(), 'user': self.client_id, 'rate': self.rate, 'lr': self.lr,
                        'seen': seen, 'label_sum': label_sum, 'batches': batches}
        """,
    "resnet_server.py": """\
        import json
        import math
        import ray
        import torch

        class ResnetServerRoll:
            kind = 'roll'

            def __init__(self, global_model, rate, dataset_ref, cfg_id):
                self.cfg, self.model_rate = ray.get(cfg_id), rate
                self.dataset_ref, self.rounds, self.global_model = dataset_ref, 0, global_model
                keys = ('lr', 'momentum', 'weight_decay', 'milestones', 'factor', 'batch_size', 'num_epochs',
                        'init_seed', 'data_shape')
                self.record = {'kind': self.kind, 'rates': list(rate), 'rounds': [],
                               'label_split': ray.get(dataset_ref['label_split']),
                               'cfg': {k: self.cfg[k] for k in keys}}

            def distribute(self, user_idx):
                state = self.global_model.state_dict()
                return [{'linear.weight': state['linear.weight'][:, :math.ceil(4 * self.model_rate[u])],
                         'linear.bias': state['linear.bias'].clone()} for u in user_idx], None

            def broadcast(self, local, lr):
                self.user_idx = list(range(len(self.model_rate)))
                params, _ = self.distribute(self.user_idx)
                ray.get([client.update.remote(self.user_idx[m], self.dataset_ref,
                                              {'lr': lr, 'model_rate': self.model_rate[self.user_idx[m]],
                                               'local_params': ray.put(params[m])}) for m, client in enumerate(local)])
                return local, None, self.user_idx

            def step(self, local_parameters, param_idx, user_idx):
                self.rounds += 1
                self.record['rounds'].append([{k: v for k, v in p.items() if k != 'state'} for p in local_parameters])
                nearest = 3 * self.rounds % 10
                bias = 10.0 - (torch.arange(10.0) - nearest).abs()
                self.global_model.load_state_dict({**self.global_model.state_dict(), 'linear.bias': bias})
                with open(f"fake_{self.cfg['init_seed']}.json", 'w') as handle:
                    json.dump(self.record, handle)

        class ResnetServerStatic(ResnetServerRoll):
            kind = 'static'
        """,
}


def fake_reference(root):
    for name, text in FAKE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def refusal(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        rolex.parse_args(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_refusals_name_what_is_wrong(tmp_path, capsys):
    ref = str(fake_reference(tmp_path / "ref"))
    out = ["--out", str(tmp_path / "out")]
    (tmp_path / "empty").mkdir()
    assert "lacks resnet_server.py, resnet_client.py, models/resnet.py, utils.py, config.yml" in refusal(
        capsys, ["--reference", str(tmp_path / "empty"), *out])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "is not empty" in refusal(capsys, ["--reference", ref, "--out", str(tmp_path / "full")])
    assert "--rounds must be at least 1" in refusal(capsys, ["--reference", ref, *out, "--rounds", "0"])
    assert "--reference DIR and --out DIR" in refusal(capsys, ["--reference", ref])
    with pytest.raises(SystemExit):  # random is not wired (its official subsets are per layer)
        rolex.parse_args(["--reference", ref, *out, "--slice", "random"])


def test_both_sides_get_the_same_settings(tmp_path):
    """The reference's settings come from our resolved config: the group's per-client levels
    (round robin, not the reference's contiguous blocks), the optimiser and the schedule."""
    args = rolex.parse_args(["--reference", str(fake_reference(tmp_path / "ref")), "--out", str(tmp_path / "out"),
                             "--clients", "7", "--rounds", "4", "--lr", "0.05", "--batch-size", "8",
                             "--local-epochs", "2", "--slice", "static", "--seed", "5"])
    out = tmp_path / "out"
    settings = rolex.reference_settings(args, out)
    assert settings == {"rates": [1.0, 0.5, 0.25, 0.125, 0.0625, 1.0, 0.5], "rounds": 4, "lr": 0.05,
                        "momentum": 0.9, "weight_decay": 0.001, "milestone": 1200, "factor": 0.25, "batch_size": 8,
                        "local_epochs": 2, "server": "ResnetServerStatic"}
    argv = rolex.reference_argv(args, out, settings, 2)
    assert argv[2:] == [
        "reference-run", "--clone", str(tmp_path / "ref"), "--split", str(out / "dataset" / "FMNIST"),
        "--server", "ResnetServerStatic", "--seed", "6", "--rates", "1,0.5,0.25,0.125,0.0625,1,0.5", "--rounds", "4",
        "--lr", "0.05", "--momentum", "0.9", "--weight-decay", "0.001", "--milestone", "1200", "--factor", "0.25",
        "--batch-size", "8", "--local-epochs", "2", "--out-json", str(out / "reference_2" / "accuracies.json")]
    ours = rolex.our_argv(args, out)
    assert ours[ours.index("--config") + 1].endswith("configs/cifar10_fedrolex_resnet18.yaml")
    assert {"rounds=4", "num_clients=7", "join_ratio=1.0", "eval_every=1", "train.lr=0.05", "train.batch_size=8",
            "train.local_epochs=2", "algo.slice=static", "data.partition=pfllib", "runtime.threads=1",
            f"data.pfllib_dir={out / 'dataset' / 'FMNIST'}"} <= set(ours)


def test_the_stand_ins_run_actors_in_process_and_cuda_on_the_cpu():
    ray = rolex.ray_stand_in()

    @ray.remote(num_gpus=0.5)
    class Counter:
        def __init__(self, start):
            self.value = start

        def add(self, step):
            self.value += step
            return self.value

    actor = Counter.remote(3)
    assert ray.get([actor.add.remote(2), actor.add.remote(1)]) == [5, 6]  # in order, at once
    assert ray.get(ray.put({"a": 1})) == {"a": 1}
    plain = ray.remote(Counter._cls).remote(1)
    assert plain.add.remote(1) == 2

    calls = []
    to = rolex._on_cpu(lambda self, *args, **kwargs: calls.append((args, kwargs)))
    to(None, "cuda", torch.float64)
    to(None, device="cuda:1", non_blocking=True)
    to(None, torch.float16)
    assert calls == [(("cpu", torch.float64), {}), ((), {"device": "cpu", "non_blocking": True}),
                     ((torch.float16,), {})]
    with pytest.raises(AttributeError):  # import machinery and inspect probe dunders
        rolex._anytree_attribute("__file__")
    with pytest.raises(RuntimeError, match=r"anytree\.Node is not installed"):
        rolex._anytree_attribute("Node")()


def split_files(split):
    """(train y, test y) per client, from the written files."""
    def labels(part, client):
        return np.load(split / part / f"{client}.npz", allow_pickle=True)["data"].tolist()["y"]
    clients = len(list((split / "train").glob("*.npz")))
    return [(labels("train", c), labels("test", c)) for c in range(clients)]


def expected_accuracy(clients, round_number: int) -> float:
    """The fake's head after round r: the masked argmax is the held class nearest (3 r) mod 10."""
    nearest, correct, total = 3 * round_number % 10, 0, 0
    for train_y, test_y in clients:
        held = sorted(set(train_y.tolist()))
        predicted = min(held, key=lambda k: (abs(k - nearest), k))
        correct, total = correct + int((test_y == predicted).sum()), total + len(test_y)
    return correct / total


@pytest.mark.launch
def test_play_against_a_fake_reference(tmp_path):
    ref, out = fake_reference(tmp_path / "ref"), tmp_path / "out"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "fedrolex_side_by_side.py"), "--reference", str(ref),
                           "--out", str(out), "--clients", "3", "--subsample", "0.002", "--rounds", "2",
                           "--reference-runs", "2", "--seed", "7", "--lr", "0.02"],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr + (out / "reference_1" / "output.log").read_text()
    clients = split_files(out / "dataset" / "FMNIST")
    result = json.loads((out / "fedrolex_side_by_side.json").read_text())
    rows = result["rounds"]
    expected = [100 * expected_accuracy(clients, r) for r in (1, 2)]
    assert [r["reference"] for r in rows] == [[pytest.approx(e), pytest.approx(e)] for e in expected]
    assert [r["spread"] for r in rows] == [0.0, 0.0]
    metrics = [json.loads(line) for line in (out / "ours" / "metrics.jsonl").read_text().splitlines()]
    assert [r["ours"] for r in rows] == [pytest.approx(100 * m["test_acc"]) for m in metrics] and len(metrics) == 2
    assert rows[1]["ours_minus_mean"] == pytest.approx(rows[1]["ours"] - expected[1])
    for run, seed in ((1, 7), (2, 8)):
        record = json.loads((ref / f"fake_{seed}.json").read_text())
        assert record["kind"] == "roll" and record["rates"] == [1.0, 0.5, 0.25]
        assert record["label_split"] == [sorted(set(train_y.tolist())) for train_y, _ in clients]
        assert record["cfg"] == {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.001, "milestones": [1200],
                                 "factor": 0.25, "batch_size": {"train": 10, "test": 1000},
                                 "num_epochs": {"global": 2, "local": 1}, "init_seed": seed, "data_shape": [1, 28, 28]}
        for uploads in record["rounds"]:  # every client trained on all of its own training samples
            assert [(u["user"], u["rate"], u["lr"], u["seen"], u["label_sum"]) for u in uploads] == [
                (c, [1.0, 0.5, 0.25][c], 0.02, len(y), int(y.sum())) for c, (y, _) in enumerate(clients)]
        assert "stand-ins: " in (out / f"reference_{run}" / "output.log").read_text()
    table = (out / "fedrolex_side_by_side.md").read_text()
    assert "run k with seed {seed} = 7, 8" in table and "--seed {seed}" in table and "commit: unknown" in table
    theirs = rolex.cell(expected[1])
    assert f"| 2 | {rolex.cell(rows[1]['ours'])} | {theirs} | {theirs} | 0.00 |" in table
    assert table.splitlines()[-1] in done.stdout
