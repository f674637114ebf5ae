"""Model zoo: architectures split into a K-dimensional feature extractor and a head.

Public interface (the runtime relies on exactly this):

* :class:`SplitModel` — ``feature_extractor`` (images -> (B, K)), ``head`` ((B, K) -> logits),
  ``feature_dim`` (K), ``features(x)``, ``forward(x)``, ``forward_with_features(x)``.
* :func:`build_model` — a freshly initialised model of ``ARCH`` (default head ``fc`` =
  ``Linear(K, C)``) or ``ARCH:HEAD`` (that extractor with a registered head, e.g.
  ``resnet34:fc512``); draws from torch's global RNG, never seeds it.
* :func:`members_in_use` — the distinct architectures a run's clients get, sorted.
* :func:`architecture_for_client` — ``group[client_id mod len(group)]``; a single ``ARCH`` or
  ``ARCH:HEAD`` is a homogeneous group of one.
* :func:`model_groups`, :func:`architectures`, :func:`register_architecture`,
  :func:`split_architecture`.
* :func:`spelled_out_model_options` — ``model.options`` checked against the group's members
  (architectures registered with an options dataclass) and written out in full.
* Heads: :func:`heads`, :func:`build_head`, :func:`register_head`, :data:`HEAD_GROUPS`
  (FedTGP's HtC4 = ``fc``, ``fc512``, ``fc256``, ``fc128``; the two-FC heads have a ReLU between
  their layers, our resolution).

* :func:`load_pretrained` — ``model.pretrained``: a client's feature extractor (or whole model)
  from a directory of per-architecture weight files (:mod:`htfl_dist.models.pretrained`);
  :func:`pretrained_identity` / :func:`pretrained_change` — the files' sha256, for checkpoints.

* :class:`InputSpec` — one sample's kind (``image``, ``text``, ``tabular``) and shape, read from
  the data; :func:`build_model` builds for it and :func:`check_group_inputs` refuses a group that
  does not take it.

Importing the package registers the built-in architectures (images: ``cnn``,
``htcnn1``..``htcnn8``, ``googlenet``, ``mobilenet_v2``, ``resnet4/6/8/10/18/34/50/101/152``,
``vit_b_16``, ``vit_b_32``; sensor windows: the HARCNN family; text: ``fasttext``,
``text_logreg``, ``lstm``, ``bilstm``, ``gru``, ``transformer_h*_l*``; tabular: ``amazon_mlp*``),
the built-in heads, and the groups ``HtCNN8``, ``HtFE2/3/4/5/8/9``, ``HtM10``, ``Res34-HtC4`` and
``HtFE8-HtC4`` (client ``i`` gets ``HtFE8[i mod 8]`` with ``HtC4[i mod 4]``), HtFLlib's sensor,
text and tabular groups under HtFLlib's names (``HtFE-sen-2``, ``HtFE-txt-6``, ``MLPs``, ...),
and HtFLlib's image group names as aliases of ours (:data:`HTFLLIB_IMAGE_GROUPS`).
"""
# Imported for their side effect: registering the built-in architectures.
from . import cnn as _cnn  # noqa: F401
from . import sensor as _sensor  # noqa: F401
from . import tabular as _tabular  # noqa: F401
from . import text as _text  # noqa: F401
from . import torchvision_zoo as _torchvision_zoo  # noqa: F401
from . import width_scaled as _width_scaled  # noqa: F401  (HeteroFL's hetero_cnn_a..e, hetero_resnet18_a..e)
from .base import SplitModel
from .head_split import FeaturePool, adapt_input_channels, split_classifier
from .heads import HEAD_GROUPS, build_head, heads, register_head
from .inputs import InputSpec, split_tokens
from .options import spelled_out_model_options
from .pretrained import load_pretrained, pretrained_change, pretrained_identity
from .registry import (
    HTFLLIB_IMAGE_GROUPS,
    InputNeed,
    architecture_for_client,
    architectures,
    build_model,
    check_group_inputs,
    initial_client_model,
    members_in_use,
    model_groups,
    register_architecture,
    register_model_group,
    resolve_group,
    split_architecture,
)

__all__ = [
    "HEAD_GROUPS",
    "HTFLLIB_IMAGE_GROUPS",
    "FeaturePool",
    "InputNeed",
    "InputSpec",
    "SplitModel",
    "adapt_input_channels",
    "architecture_for_client",
    "architectures",
    "build_head",
    "build_model",
    "check_group_inputs",
    "heads",
    "initial_client_model",
    "load_pretrained",
    "members_in_use",
    "model_groups",
    "pretrained_change",
    "pretrained_identity",
    "register_architecture",
    "register_head",
    "register_model_group",
    "resolve_group",
    "spelled_out_model_options",
    "split_architecture",
    "split_classifier",
    "split_tokens",
]
