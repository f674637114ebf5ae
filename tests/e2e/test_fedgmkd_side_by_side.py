"""bench/fedgmkd_side_by_side.py against a fake reference laid out as SereinZY/FedGMKD (CI cannot
fetch the real one): flat files that import each other as ``Client.*`` and ``Server.*`` and
import modules the script stands in for. The fake's server mixes positions and client ids as the
real one does (so it needs the participants in id order), weighs by (n_i + b) over all
participants (FedGMKD's rule at a = 0, without the real code's defects), its client uploads the
standardised mean (0) and the mean soft prediction, and does not train. So the script must find
ours at a = 0 equal to it, ours at a = 0.4 not, both prototypes equal, ours in one round
exactly as far from it as from the start, and one record per round of its whole loop."""
from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO))  # the script imports bench.fedpac_side_by_side, as run with PYTHONPATH=.
script = importlib.import_module("bench.fedgmkd_side_by_side")

FAKE = {
    "utils.py": '''\
        import torch
        def soft_predict(Z, temp):
            return torch.softmax(Z / temp, dim=1)
        ''',
    "ClientBase.py": '''\
        import copy
        class Client:
            def __init__(self, args, model, Loader_train, loader_test, idx, logger, code_length, num_classes, device):
                self.args, self.trainloader, self.model = args, Loader_train, copy.deepcopy(model)
        ''',
    "ClientFedGMKD.py": '''\
        import torch
        from Client.ClientBase import Client
        from utils import soft_predict
        class ClientFedGMKD(Client):
            def generate_knowledge(self, temp):
                features, soft = {}, {}
                for X, y in self.trainloader:
                    F, Z = self.model(X)
                    for i, label in enumerate(y.tolist()):
                        features.setdefault(label, []).append(F[i].detach())
                        soft.setdefault(label, []).append(soft_predict(Z, temp)[i].detach())
                return ({k: [torch.zeros(self.args.code_len)] for k in features},
                        {k: [torch.stack(v).mean(dim=0)] for k, v in soft.items()})
            def get_nk_dk(self):
                return len(self.trainloader.dataset), {}
            def update_weights(self, global_round):
                return self.model.state_dict(), 0.0
            def update_weights_GMKD(self, global_features, global_soft_prediction, lam, gamma, temp, global_round):
                return self.model.state_dict(), 0.0
        ''',
    "ServerBase.py": '''\
        class Server:
            def __init__(self, args, global_model, Loader_train, Loaders_local_test, Loader_global_test, logger,
                         device):
                self.args, self.global_model, self.LocalModels = args, global_model, []
        ''',
    "ServerFedGMKD.py": '''\
        import numpy as np
        from tqdm import tqdm
        from mem_utils import MemReporter
        from sampling import LocalDataset, LocalDataloaders, partition_data
        from Server.ServerBase import Server
        from Client.ClientFedGMKD import ClientFedGMKD
        class ServerFedGMKD(Server):
            def train(self):
                n, C, b = self.args.num_clients, self.args.num_classes, 0.2
                for epoch in tqdm(range(self.args.num_epochs)):
                    idxs = np.random.choice(range(n), n, replace=False)
                    nks = [self.LocalModels[i].get_nk_dk()[0] for i in idxs]
                    knowledge = [self.LocalModels[i].generate_knowledge(self.args.temp) for i in idxs]
                    total = sum(nk + b for nk in nks)
                    features, soft = {}, {}
                    for position, idx in enumerate(idxs):  # a position and an id mixed, as the real code
                        for k, row in knowledge[position][0].items():
                            features[k] = features.get(k, 0) + row[0] * (nks[idx] + b) / total
                        for k, row in knowledge[position][1].items():
                            soft[k] = soft.get(k, 0) + row[0] * (nks[idx] + b) / total
                    for i in idxs:
                        if epoch == 0:
                            self.LocalModels[i].update_weights(global_round=epoch)
                        else:
                            self.LocalModels[i].update_weights_GMKD(
                                global_features={k: [v] for k, v in features.items()},
                                global_soft_prediction={k: [v] for k, v in soft.items()},
                                lam=0.06, gamma=0.06, temp=self.args.temp, global_round=epoch)
                MemReporter().report()
        ''',
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> object:
    clone = tmp_path_factory.mktemp("fedgmkd_clone")
    for name, text in FAKE.items():
        (clone / name).write_text(textwrap.dedent(text))
    return script.load_reference(clone)


def test_the_fake_loads_and_leaves_nothing_behind(reference: object) -> None:
    assert not {"tqdm", "mem_utils", "sampling", "utils", "Client", "Server", "Client.ClientBase",
                "ServerFedGMKD"} & set(sys.modules)
    assert not any("fedgmkd_clone" in entry for entry in sys.path)


def test_knowledge_is_compared_in_the_right_spaces(reference: object) -> None:
    differences = script.knowledge_differences(reference)
    assert differences["standardised prototypes"] < 1e-12  # 0 against our ≈ 1e-16
    assert differences["largest official prototype entry"] == 0
    assert differences["mapped-back prototypes"] < 1e-5  # the class mean both sides (float32 features)
    assert differences["soft predictions"] < 1e-6


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_server_is_driven_in_order_and_compared_per_round(reference: object, symmetric: bool) -> None:
    np.random.seed(0)  # the order the script must override
    rounds = script.server_differences(reference, symmetric)
    assert len(rounds) == 2
    for ours, control, replayed in rounds:
        assert control < 1e-6, "the fake is FedGMKD at a = 0"
        assert ours > 1e-3, "the discrepancy term moves ours"
        assert replayed > 1e-3, "the real code's defects are not the fake's"


def test_one_round_is_measured_against_the_reference_weights(reference: object) -> None:
    differences = script.training_differences(reference)
    assert differences["moved"] > 1e-2
    assert differences["parameters"] == pytest.approx(differences["moved"], abs=1e-7)  # the fake does not train
    assert abs(differences["ours unclipped"] - differences["parameters"]) > 1e-3  # the clip acts


def test_whole_rounds_record_each_round_and_its_knowledge(reference: object) -> None:
    rounds = script.one_client_rounds(reference, rounds=3)
    assert len(rounds) == 3
    fresh, kept, alone, zeroed = zip(*rounds, strict=True)
    assert fresh[0] > 1e-3 and fresh[0] == kept[0]  # the fake does not train; round 1 starts one optimiser
    assert kept[1] != fresh[1]  # Adam's state kept from round 1 moves round 2
    assert alone == zeroed  # the fake's prototypes are exactly 0
    assert all(a > 1e-3 for a in alone[1:])
