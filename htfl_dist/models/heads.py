"""Head registry: the classifiers ``R^K -> R^C`` a client model may end in.

By default every architecture ends in ``fc`` = :func:`~htfl_dist.models.base.linear_head`, one
``Linear(K, C)``, the same shape on every client (what LG-FedAvg/FedGH-style head sharing needs).
FedTGP's appendix also studies *heterogeneous classifiers*, the HtC4 group made only of FC
layers (written there for Cifar100, so "100-d" is C):

1. ``fc``: one C-way FC;
2. ``fc512``: a 512-way FC, then a C-way FC;
3. ``fc256``: a 256-way FC, then a C-way FC;
4. ``fc128``: a 128-way FC, then a C-way FC.

**[I]** Between the two FC layers we put a ReLU: the paper names only the FC widths, but two
stacked linear maps without a nonlinearity compose to a single ``Linear(K, C)`` (of rank at most
the hidden width), so without it the four heads would differ only in parametrisation.

HtFLlib's ``Head`` (the reference code behind the paper's HtC4 numbers) differs: it puts a
ReLU after *every* FC layer, the last one included, so its logits are never negative. The
heads ``fc_relu``, ``fc512_relu``, ``fc256_relu``, ``fc128_relu`` (group ``HtC4-htfllib``)
build exactly that, for reproducing the reference code's tables.

A head is attached to an architecture by the ``ARCH:HEAD`` spelling (``resnet34:fc512``), see
:mod:`htfl_dist.models.registry`. Head builders, like architecture builders, draw all their
randomness from torch's global RNG and never seed it.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

from torch import nn

from htfl_dist.errors import ConfigError
from htfl_dist.registry import Registry

from .base import check_new_name, linear_head, natural_key

HeadBuilder = Callable[[int, int], nn.Module]
"""``(feature_dim, num_classes) -> module`` mapping ``(B, K)`` features to ``(B, C)`` logits."""

DEFAULT_HEAD = "fc"
"""The head an architecture gets when its name carries no ``:HEAD`` suffix."""

HEAD_GROUPS: dict[str, tuple[str, ...]] = {
    # FedTGP appendix, "Architectures of HtC4": client i gets HtC4[i mod 4].
    "HtC4": ("fc", "fc512", "fc256", "fc128"),
    # The same widths as HtFLlib's Head builds them: a ReLU after the last FC layer too.
    "HtC4-htfllib": ("fc_relu", "fc512_relu", "fc256_relu", "fc128_relu"),
}

_HEADS: Registry[HeadBuilder] = Registry("head", order=natural_key, plumbing=(__name__, "htfl_dist.models.base"))


def register_head(name: str) -> Callable[[HeadBuilder], HeadBuilder]:
    """Decorator registering a head builder under ``name``. Registering a name twice is a bug."""

    def decorator(builder: HeadBuilder) -> HeadBuilder:
        check_new_name(_HEADS, name)
        return _HEADS.add(name, builder)

    return decorator


def heads() -> list[str]:
    """All registered head names, in natural order (``fc, fc128, fc256, fc512``)."""
    return _HEADS.names()


def check_head(name: str, spec: str = "") -> None:
    """Raise a one-line :class:`ConfigError` listing the allowed heads if ``name`` is unknown.

    ``spec`` is the ``ARCH:HEAD`` string the name came from, quoted in the message when given.
    """
    if name not in _HEADS:  # the one name rule (htfl_dist.registry): any case finds a head
        where = f" in {spec!r}" if spec else ""
        raise ConfigError(f"unknown head {name!r}{where}; allowed heads: {', '.join(heads())}")


def registered_head(name: str) -> str:
    """``name`` as the head was registered (the one name rule finds it in any case)."""
    check_head(name)
    return _HEADS.spelling(name) or name


def build_head(name: str, feature_dim: int, num_classes: int) -> nn.Module:
    """A freshly initialised head ``name`` mapping ``(B, feature_dim)`` to ``(B, num_classes)``.

    Raises:
        ConfigError: unknown ``name``.
    """
    check_head(name)
    return _HEADS.get(name)(feature_dim, num_classes)


def hidden_fc_head(feature_dim: int, hidden_dim: int, num_classes: int) -> nn.Sequential:
    """``Linear(K, hidden) -> ReLU -> Linear(hidden, C)``: an HtC4 two-FC head (ReLU is [I])."""
    return nn.Sequential(nn.Linear(feature_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, num_classes))


@register_head(DEFAULT_HEAD)
def build_fc_head(feature_dim: int, num_classes: int) -> nn.Module:
    """The default head, exactly :func:`linear_head` (so ``ARCH:fc`` means what ``ARCH`` means)."""
    return linear_head(feature_dim, num_classes)


def _register_hidden_fc(hidden_dim: int) -> None:
    @register_head(f"fc{hidden_dim}")
    def build(feature_dim: int, num_classes: int) -> nn.Module:
        return hidden_fc_head(feature_dim, hidden_dim, num_classes)

    build.__name__ = f"build_fc{hidden_dim}_head"
    build.__doc__ = f"HtC4 head: {hidden_dim}-way FC, ReLU, C-way FC."


for _hidden in (512, 256, 128):
    _register_hidden_fc(_hidden)


def relu_after_every_fc_head(feature_dim: int, hidden_dims: tuple[int, ...], num_classes: int) -> nn.Sequential:
    """HtFLlib's ``Head``: ``Linear -> ReLU`` for every width in ``(*hidden_dims, C)``."""
    widths = (feature_dim, *hidden_dims, num_classes)
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers)


def _register_htfllib_head(hidden_dims: tuple[int, ...]) -> None:
    name = f"fc{hidden_dims[0]}_relu" if hidden_dims else "fc_relu"

    @register_head(name)
    def build(feature_dim: int, num_classes: int) -> nn.Module:
        return relu_after_every_fc_head(feature_dim, hidden_dims, num_classes)

    build.__name__ = f"build_{name}_head"
    build.__doc__ = "HtFLlib's HtC4 Head: FC layers each followed by a ReLU (non-negative logits)."


for _hidden_dims in ((), (512,), (256,), (128,)):
    _register_htfllib_head(_hidden_dims)


@register_head("fc768_tanh")
def build_vit_head(feature_dim: int, num_classes: int) -> nn.Module:
    """The head HtFLlib gives its ViTs: ``Linear(K, 768) -> Tanh -> Linear(768, C)`` (the
    ``vit_b_16`` / ``vit_b_32`` members' own head)."""
    return nn.Sequential(nn.Linear(feature_dim, 768), nn.Tanh(), nn.Linear(768, num_classes))
