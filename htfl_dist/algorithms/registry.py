"""The one registry of algorithms: name → (server, client, options, what it shares).

Two capability flags follow from the classes and are derived at registration
(``batched_clients``, ``evaluation_installs_knowledge``): a flag passed explicitly must agree with
the classes, else registration is refused in one line. What the conformance checks
(``htfl_dist.testing``) need to know of an algorithm beyond its classes is its
``ConformanceHints``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from htfl_dist.algorithms.interface import ClientAlgorithm, ServerAlgorithm
from htfl_dist.config import declare_algorithm_options
from htfl_dist.config.loading import checked_section
from htfl_dist.registry import Registry, name_key


@dataclass(frozen=True)
class ConformanceHints:
    """What the conformance checks (``htfl_dist.testing``) need to know of one algorithm beyond its
    classes. The defaults fit an algorithm that runs on the checks' small run as it is and is
    launched on 3 ranks by the checks themselves."""

    overrides: tuple[str, ...] = ()
    """``key=value`` settings every check adds to its small run (two rounds of the smoke config:
    6 HtCNN8 clients on 2 % of Fashion-MNIST): a model group the method needs (a FedPer:
    ``model.group=cnn``), a cheaper setting (FedKD: a smaller mentee) or partial participation."""
    ranks_covered_by: str = ""
    """A registered algorithm whose 3-rank launch stands for this one's, because their messages
    travel through the same code (LG-FedAvg and FedGH: FedGen's model-part block); what differs
    between them is their maths, which the one-process checks cover per algorithm. Empty: the
    launch runs this algorithm itself (unless ``ranks_checked_in`` says where else it runs)."""
    ranks_checked_in: str = ""
    """Where this algorithm's own tests launch it on several ranks and check more than equality
    (a sentence naming the test file); the conformance launch then leaves it out."""

    def __post_init__(self) -> None:
        if isinstance(self.overrides, str) or not all(isinstance(item, str) and "=" in item
                                                      for item in self.overrides):
            raise ValueError(f"conformance overrides must be key=value strings, got {self.overrides!r}")
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.ranks_covered_by and self.ranks_checked_in:
            raise ValueError("conformance hints name both ranks_covered_by and ranks_checked_in; name one")

    @property
    def launched(self) -> bool:
        """Whether the conformance launch (1 process = 3 ranks) runs this algorithm itself."""
        return not (self.ranks_covered_by or self.ranks_checked_in)


@dataclass(frozen=True)
class AlgorithmEntry:
    name: str
    server: type[ServerAlgorithm]
    client: type[ClientAlgorithm]
    options: type
    summary: str
    shares_parameters: bool = False
    """True only where the method's paper shares model parameters (a head, a shared model, a
    generator); every other algorithm sends class knowledge only, and the conformance test holds
    it to that."""
    uses_generator: bool = False
    """True for FedKTL: rank 0 loads ``generator.*`` and passes it to the server as
    ``server(context, generator=...)``; every rank learns its latent width (``context.latent_dim``)."""
    private_release: bool = False
    """True where everything a client uploads is class rows from ``class_rows.class_means`` and
    every gradient its local training takes from the client's samples goes through DP-SGD
    (``training.run_local_training``, or ``client.private.train`` with a public term
    computed from downloads only, FedKTL's): ``privacy.*`` then noises the rows and clips and
    noises those gradients (docs/privacy.md). Any other algorithm is refused at start-up when
    privacy is on."""
    batched_clients: bool = False
    """True where the client's ``train_group`` is a batched path of its ``train`` (the same loss,
    equal results within float tolerance, whoever shares the group): ``train.client_batching=vmap``
    is accepted only then. Derived at registration (``has_batched_path``): the class that
    ``train_group`` resolves to defines its own and no class below it redefines ``train``. A
    subclass that changes ``train`` but inherits a batched ``train_group`` would batch the parent's
    loss, so it is not batched."""
    evaluation_installs_knowledge: bool = False
    """True where the client's ``prepare_evaluation`` changes the client (installs a downloaded
    head or shared model): the runtime then hands it a client it keeps, rather than a read-only
    look at a parked one. Derived at registration (``installs_knowledge``): the client overrides
    ``ClientAlgorithm.prepare_evaluation``, a no-op."""
    conformance: ConformanceHints = ConformanceHints()
    """What the conformance checks need beyond the classes (``htfl_dist.testing``)."""

    @property
    def sums_only(self) -> bool:
        """The server needs only the sum of the round's contributions (:func:`sums_only`): it can
        run under secure aggregation, and its uploads can be summed where they are made."""
        return sums_only(self.server)


_REGISTRY: Registry[AlgorithmEntry] = Registry("algorithm", "algorithm", order=name_key, plumbing=(__name__,))


def defined_by(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose own body defines attribute ``name`` (what a look-up finds)."""
    return next(klass for klass in cls.__mro__ if name in vars(klass))


def installs_knowledge(client: type[ClientAlgorithm]) -> bool:
    """``evaluation_installs_knowledge`` of a client class: it overrides the base's no-op
    ``prepare_evaluation``, so evaluating it may change it."""
    return defined_by(client, "prepare_evaluation") is not ClientAlgorithm


def has_batched_path(client: type[ClientAlgorithm]) -> bool:
    """``batched_clients`` of a client class: the ``train_group`` it resolves to is an override
    (not the base's one-by-one loop) written at or below the class whose ``train`` it resolves to.
    FedOC and FedSA redefine ``train`` below the prototype client's batched ``train_group``:
    batching them would train the parent's loss, so they have no batched path."""
    group = defined_by(client, "train_group")
    return group is not ClientAlgorithm and issubclass(group, defined_by(client, "train"))


def vouched_concurrent(client: type[ClientAlgorithm]) -> bool:
    """Whether ``client``'s ``trains_concurrently`` holds for it: the class whose body says True is
    ``client`` itself or a base that no class below it changes (no method defined in between). A
    subclass that rewrites ``train`` or its loss, and keeps state on ``self`` there, must not
    inherit the claim: it says so again (FedProto's client does), or it trains one at a time."""
    declarer = defined_by(client, "trains_concurrently")
    if not vars(declarer)["trains_concurrently"]:
        return False
    below = client.__mro__[: client.__mro__.index(declarer)]
    return not any(callable(value) or isinstance(value, (classmethod, staticmethod))
                   for klass in below for name, value in vars(klass).items() if not name.startswith("__"))


def sums_only(server: type[ServerAlgorithm]) -> bool:
    """Whether ``server`` needs only the sum of the round's contributions: it declares
    ``summed_fields`` and its ``update_from_sums`` is written at or below the class its ``update``
    comes from. A subclass that rewrites ``update`` (FedPCL's, FedGen's) but inherits the parent's
    sums would aggregate the parent's way under secure aggregation, so it is not sums-only."""
    declares = defined_by(server, "summed_fields") is not ServerAlgorithm
    return declares and issubclass(defined_by(server, "update_from_sums"), defined_by(server, "update"))


def _checked_flag(name: str, flag: str, declared: bool | None, derived: bool, reason: str) -> bool:
    if declared is None or declared == derived:
        return derived
    if flag == "batched_clients" and declared is False:
        return False  # declining a batched path is safe: the runtime then refuses train.client_batching=vmap
    raise ValueError(f"algorithm {name!r} is registered with {flag}={declared}, but {reason}; leave {flag} out "
                     f"(it is derived from the classes)")


def register_algorithm(name: str, *, server: type[ServerAlgorithm], client: type[ClientAlgorithm],
                       options: type, summary: str, shares_parameters: bool = False,
                       uses_generator: bool = False, private_release: bool = False,
                       batched_clients: bool | None = None, evaluation_installs_knowledge: bool | None = None,
                       conformance: ConformanceHints | None = None) -> None:
    """Register an algorithm under ``name``, with what it declares it can do (AlgorithmEntry's
    flags); the runtime reads the entry and never inspects the classes.

    ``batched_clients`` and ``evaluation_installs_knowledge`` are derived from ``client``
    (``has_batched_path``, ``installs_knowledge``); left out, they take the derived value. Passed,
    they must agree with it, else a ValueError names the algorithm and the flag (an algorithm that
    says it installs nothing at evaluation while it does would lose what it installs whenever its
    clients are parked). ``batched_clients=False`` is always accepted: it declines a batched path."""
    source = _REGISTRY.check_free(name)
    if not (isinstance(client, type) and issubclass(client, ClientAlgorithm)):
        raise ValueError(f"algorithm {name!r}: client must be a ClientAlgorithm subclass, got {client!r}")
    if conformance is not None and not isinstance(conformance, ConformanceHints):
        raise ValueError(f"algorithm {name!r}: conformance must be a ConformanceHints, got {conformance!r}")
    installs = installs_knowledge(client)
    where = defined_by(client, "prepare_evaluation").__qualname__
    evaluation_installs_knowledge = _checked_flag(
        name, "evaluation_installs_knowledge", evaluation_installs_knowledge, installs,
        f"its client {client.__qualname__} overrides prepare_evaluation ({where}.prepare_evaluation)" if installs
        else f"its client {client.__qualname__} keeps the base prepare_evaluation, which installs nothing")
    batched = has_batched_path(client)
    group, train = defined_by(client, "train_group"), defined_by(client, "train")
    batched_clients = _checked_flag(
        name, "batched_clients", batched_clients, batched,
        f"its client {client.__qualname__} trains a group one by one (train_group is the base's)"
        if group is ClientAlgorithm else
        f"its client {client.__qualname__} takes train from {train.__qualname__} but train_group from "
        f"{group.__qualname__}, which batches another train")
    declare_algorithm_options(name, options)  # the hash walks its fields' declared identity
    _REGISTRY.add(name, AlgorithmEntry(name, server, client, options, summary, shares_parameters, uses_generator,
                                       private_release, batched_clients, evaluation_installs_knowledge,
                                       conformance or ConformanceHints()), source=source)


def algorithm_names() -> list[str]:
    """Every algorithm as registered, sorted by the name rule's key."""
    return _REGISTRY.names()


def is_algorithm(name: str) -> bool:
    """Whether ``name`` finds an algorithm under the one name rule."""
    return name in _REGISTRY


def get_algorithm(name: str) -> AlgorithmEntry:
    """The entry ``name`` finds under the one name rule (``htfl_dist.registry``)."""
    return _REGISTRY.get(name)


def parse_options(entry: AlgorithmEntry, raw: dict[str, Any]) -> Any:
    """Validate ``algo.*`` against the algorithm's options dataclass: names and types, the
    ranges its fields declare with ``config.bounded``, then its own ``validate`` (choices that
    depend on each other, ``compat`` resolving the knobs left unset)."""
    return checked_section(entry.options, raw, "algo.")


def spelled_out_options(algorithm: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``algo.*`` validated and with every option written out: the form a config is stored and
    compared in, so writing a default explicitly is not a different experiment."""
    return dataclasses.asdict(parse_options(get_algorithm(algorithm), raw))
