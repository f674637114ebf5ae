"""The experiment identity of every shipped config, pinned. A run directory is resumed only by a
config with the same hash, and a paper-table config's hash says which experiment its numbers
came from, so a change to the schema, the option defaults or the hashing that moves any of these
is caught here. Changing one on purpose (a config now runs what its table ran) means updating it
here and saying why in the commit."""
from __future__ import annotations

import pytest

from conftest import REPO
from htfl_dist.resolution import resolved_config

UNCHANGED_SINCE_2026_11_24 = {
    "cifar100_htfe8_feddistill_dirichlet": "8c86d8b6bbfe1ae0",
    "cifar100_htfe8_fedgen_dirichlet": "4ef8e3ee9801cf0e",
    "cifar100_htfe8_fedgh_dirichlet": "a122325bc0dfdaeb",
    "cifar100_htfe8_fedkd_dirichlet": "197c6e680c596a80",
    "cifar100_htfe8_fedktl_dirichlet": "8bd3db30c4077592",
    "cifar100_htfe8_fedktl_pathological": "167bed49f44a2b62",
    "cifar100_htfe8_fedsa_dirichlet": "8bb883fa4b1bec7e",
    "cifar100_htfe8_fml_dirichlet": "a2d8f14c3ffecce7",
    "cifar100_htfe8_lgfedavg_dirichlet": "f76d1d0fcddfb86d",
    "cifar10_htfe8_fedktl_dirichlet": "2a39b07bfa376338",
    "cifar10_htfe8_fedktl_pathological": "b8c652892da66979",
    "fmnist_htcnn8_feddistill_dirichlet": "4980b3456929827e",
    "fmnist_htcnn8_feddistill_pathological": "7a281656c36cce3b",
    "fmnist_htcnn8_fedgen_dirichlet": "d2559fac043c3901",
    "fmnist_htcnn8_fedgen_pathological": "9bc5e4c4cb4b9520",
    "fmnist_htcnn8_fedkd_dirichlet": "9e96ffaad98adeb2",
    "fmnist_htcnn8_fedkd_pathological": "b89430d972c01267",
    "fmnist_htcnn8_fedproto_dirichlet": "099129104d98fb53",
    "fmnist_htcnn8_fedproto_pathological": "219db59ff61bfa90",
    "fmnist_htcnn8_fedsa_dirichlet": "05ce036f0a23e297",
    "fmnist_htcnn8_fedsa_pathological": "cb79de2c90e7e25f",
    "fmnist_htcnn8_fml_dirichlet": "164d49043459eddc",
    "fmnist_htcnn8_fml_pathological": "91bcedf6a8fb0018",
    "fmnist_htcnn8_lgfedavg_dirichlet": "8f0f4ee82e0d6724",
    "fmnist_htcnn8_lgfedavg_pathological": "ea8cd2dab77089de",
    "fmnist_htcnn8_local_dirichlet": "4097484a37bca1e9",
    "fmnist_htcnn8_local_pathological": "9a89320b3215f1c7",
    "smoke": "c29157722d092123",
}
"""Hashes these configs had before the config redesign (b82c02f): runs made then still resume."""

CHANGED_ON_PURPOSE = {
    "cifar100_cnn_fedktl_single_client": "13fd9f35d74492c0",
    "cifar100_htfe8_fedoc_pathological": "9a3ab4f2f93a1b5c",
    "fmnist_htcnn8_fedgh_dirichlet": "28d4b00f34903520",
    "fmnist_htcnn8_fedgh_pathological": "97e85e2991349656",
    "fmnist_htcnn8_fedktl_dirichlet": "af8ba365cc4f62af",
    "fmnist_htcnn8_fedktl_pathological": "405c8c2643203dff",
    "fmnist_htcnn8_fedoc_dirichlet": "6a6b37a7c6ef651f",
    "fmnist_htcnn8_fedoc_pathological": "1df0e63e54fec1ed",
    "fmnist_htcnn8_fedhkd_dirichlet": "a9930c6be318e820",  # issue 47: defaults are the reference code's
    "fmnist_htcnn8_fednh_dirichlet": "cb2b848acbf02cb3",  # issue 47: defaults and scoring the reference code's
    "fmnist_htcnn8_protonorm_dirichlet": "ca1cb0e090cefd47",  # issue 47: prototypes as the code takes them
    "fmnist_htcnn8_fpl_dirichlet": "624d022878d8c2f1",  # issue 47: the last epoch's batch features, the code's
    "fmnist_htcnn8_fedpcl_dirichlet": "608c45ae309c1775",  # issue 47: every default PFLlib's (tau 1, clip 10)
    "cifar100_htfe8_fedtgp_dirichlet": "268bc33b966c4b1b",  # issue 47: full-batch prototypes
    "cifar100_htfe8_fedtgp_pathological": "bf2114beb8e715b0",  # issue 47: full-batch prototypes
    "cifar100_htfe8htc4_fedtgp_dirichlet": "0226aafd105db946",  # issue 47: full-batch prototypes
    "cifar100_res34htc4_fedtgp_dirichlet": "af235f02dee33c85",  # issue 47: full-batch prototypes
    "cifar10_htfe8_fedtgp_dirichlet": "39f50cb72259ba63",  # issue 47: full-batch prototypes
    "cifar10_htfe8_fedtgp_pathological": "ced427a5ba6c53d8",  # issue 47: full-batch prototypes
    "flowers102_htfe8_fedtgp_dirichlet": "1d62ed5a49876bbf",  # issue 47: full-batch prototypes
    "fmnist_htcnn8_fedtgp_dirichlet": "76e322cf927169db",  # issue 47: full-batch prototypes
    "fmnist_htcnn8_fedtgp_pathological": "7b08b86f60a4a07a",  # issue 47: full-batch prototypes
    "tinyimagenet_htfe8_fedtgp_dirichlet": "48262c7fcc9e9326",  # issue 47: full-batch prototypes
}
"""Configs that now run what their table ran (see their headers), or the paper's text where no
table claims them, or their method's one readable source (issue 47)."""

ADDED_ON_2026_11_25 = {
    "agnews_htfe_txt_2_fedproto": "e110c46d72af3931",
    "har_htfe_sen_2_fedproto": "eebe8ee71b469d44",
    "fmnist_htcnn8_fedl2g_dirichlet": "12739e40767a3037",
    "fmnist_htcnn8_fedl2g_pathological": "9b68e7d75d800a19",
    "fmnist_htcnn8_fedmrl_dirichlet": "354f5b8a9e353639",
    "fmnist_htcnn8_fedmrl_pathological": "a353d7c9d6faf77b",
    "fmnist_htcnn8_fedorgp_dirichlet": "3126c2e85d1e8c7c",
}

ADDED_ON_2026_11_27 = {
}

ADDED_BY_DOMAINS = {
    "digit5_htcnn8_fedproto_domains": "56c02e9ed83ff664",
}

ADDED_BY_FEDPAC = {
    "fmnist_htcnn8_fedpac_dirichlet": "50aa461fa7f55192",
}

ADDED_BY_FEDGMKD = {
    "fmnist_htcnn8_fedgmkd_dirichlet": "f5aa64c66366388f",
}

ADDED_BY_WIDTH_SCALING = {
    "cifar10_heterofl_resnet18": "7670eea994e06696",
    "cifar10_fedrolex_resnet18": "e5aba78e737e84e7",
}

PINNED = {**UNCHANGED_SINCE_2026_11_24, **CHANGED_ON_PURPOSE, **ADDED_ON_2026_11_25, **ADDED_ON_2026_11_27,
          **ADDED_BY_DOMAINS, **ADDED_BY_FEDPAC, **ADDED_BY_WIDTH_SCALING, **ADDED_BY_FEDGMKD}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_shipped_config_keeps_its_experiment_hash(name):
    assert resolved_config(str(REPO / "configs" / f"{name}.yaml"), []).config_hash() == PINNED[name]


def test_every_shipped_config_is_pinned():
    shipped = {path.stem for path in (REPO / "configs").glob("*.yaml")}
    missing = sorted(shipped - set(PINNED))
    assert shipped == set(PINNED), f"pin these in tests/runtime/test_config_identity.py: {missing}"
