"""The ``data`` section: which data, and how it is split across logical clients (its own module
to keep the schema readable; ``schema`` re-exports it)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from htfl_dist.config.rules import ADDED_LATER, PLUMBING, bounded, declared
from htfl_dist.errors import ConfigError

DEFAULT_FMNIST_ROOT = "/usr/share/datasets/fashion-mnist"


def default_cache_dir() -> str:
    """Partition caches live outside the run directory so runs share them."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "htfl_dist", "partitions")


def partition_cache_dir(data: DataConfig) -> str:
    """Where ``data``'s partition cache lives: ``data.cache_dir``, else ``default_cache_dir()``."""
    return data.cache_dir or default_cache_dir()


@dataclass
class DataConfig:
    """Which data, and how it is split across logical clients."""

    dataset: str = "fmnist"
    """A dataset registered with ``htfl_dist.data.sources.register_dataset``: the built-in sources
    (fmnist, cifar10, cifar100, tinyimagenet, flowers102; the domain suites digit5 and domainnet)
    or a plugin's; the resolution step
    (``htfl_dist.resolution``) refuses a name no source holds."""
    root: str | None = declared(None, identity=PLUMBING)
    """Directory holding the dataset files (fmnist default: the OS package's directory). The
    others need it, never download, and take the parent of the dataset's folder or the folder
    itself: cifar-10-batches-py/, cifar-100-python/, tiny-imagenet-200/ (the extracted
    tiny-imagenet-200.zip), flowers-102/ (torchvision's layout: jpg/, imagelabels.mat, setid.mat)."""
    partition: Literal["pathological", "dirichlet", "exdir", "pfllib"] = "dirichlet"
    """exdir: PFLlib's extended Dirichlet (each client may hold ``classes_per_client`` classes
    drawn at random, shares Dir(``beta``) among them; partition_rules=pfllib only). pfllib: read a
    directory PFLlib wrote (data.pfllib_dir)."""
    beta: float = bounded(0.1, above=0, note="Dirichlet concentration")
    """Dirichlet concentration (practical setting; exdir too: PFLlib's ``alpha``)."""
    classes_per_client: int = bounded(2, at_least=1)
    """Pathological setting: classes held by each client; exdir: classes each client may hold
    (PFLlib's ``class_per_client``)."""
    balance: bool = declared(False, identity=ADDED_LATER)
    """PFLlib's ``balance=True`` (partition=pathological, partition_rules=pfllib only): a class's
    holders get equal shares (int(n / m), the last the rest) instead of PFLlib's random ones.
    PFLlib's dir and exdir ignore ``balance``; here it is refused there rather than ignored."""
    train_ratio: float = bounded(0.75, above=0, below=1)
    """Per-client train share; the rest is that client's test split."""
    subsample: float = bounded(1.0, above=0, at_most=1)
    """Fraction of the dataset used (stratified by class), for fast tests."""
    partition_seed: int | None = bounded(None, at_least=0, optional=True, note="or null: the run's seed")
    """The seed the split is drawn from (subsample, partition, train/test); unset: the run's
    ``seed``. PFLlib's generators draw one split with seed 1 and every training repetition
    reuses it: ``partition_seed: 1`` with seeds 0, 1, 2 does the same."""
    partition_rules: Literal["pfllib", "legacy"] = "pfllib"
    """How ``dirichlet`` and ``pathological`` splits are drawn (partition=pfllib reads a finished
    split and ignores this). ``pfllib`` (default; every paper's split came from PFLlib):
    PFLlib's ``separate_data`` and ``split_data`` (unbalanced ``pat``, ``dir``, sklearn's
    per-client train/test split) from one numpy ``RandomState(seed)``
    drawn in PFLlib's order, so seed 1 gives the very split PFLlib's generators write; pathological
    clients come in blocks sharing their classes, with very unequal sizes. ``legacy``: this
    project's first rules (classes assigned cyclically, Dirichlet(1) shares above a floor, guard
    10, per-purpose seeded streams; the default before this option existed, so configs that
    predate it resume only with ``partition_rules: legacy``). docs/partitions.md describes both."""
    min_samples_per_client: int | None = bounded(None, at_least=0, optional=True,
                                                 note="or null: the partition rule's own guard")
    """The partition's size guard; unset (null) means the rule's own: legacy re-draws the
    Dirichlet split until every client holds 10 samples; pfllib uses PFLlib's ``least_samples``
    = int(min(train.batch_size / (1 - data.train_ratio), samples / num_clients / 2)), 40 for
    batch 10, as the Dirichlet guard and in the pathological share floor (guard / classes). A
    number replaces the rule's own value."""
    max_partition_tries: int = bounded(1000, at_least=1)
    """Dirichlet: give up (with a clear error) after this many re-draws."""
    cache_dir: str | None = declared(None, identity=PLUMBING)
    """Where partition caches (HDF5) are written; default ~/.cache/htfl_dist/partitions."""
    pfllib_dir: str | None = None
    """partition=pfllib: a PFLlib/HtFLlib dataset directory (config.json, train/, test/)."""
    allow_pickle: bool = False
    """partition=pfllib: PFLlib's .npz files hold pickled arrays; loading them needs consent."""
    allow_changed: bool = declared(False, identity=PLUMBING)
    """Resume on data other than the checkpoint's (another source, other files, another split) on
    purpose: without it such a resume is refused; with it the run goes on and summary.json records
    the change. Not part of the experiment's hash."""
    vocab_size: int | None = bounded(None, identity=ADDED_LATER, at_least=1, at_most=1_000_000, optional=True,
                                     note="or null: the data's largest id + 1")
    """Text data: the vocabulary the text models embed (token ids 0 .. vocab_size - 1); unset: the
    largest id in the data + 1. HtFLlib sets 32000 for AG News (the tokenizer's ``max_tokens``).
    At most the cap the data's own ids are held to (``htfl_dist.data.pfllib.MAX_VOCAB_SIZE``, above
    PFLlib's largest text vocabulary): a larger one would size every text model's embedding
    (10**12 asked for 2 PB) before a single id is read."""
    few_shot: int = bounded(0, identity=ADDED_LATER, at_least=0, note="0 = off")
    """k: each client trains on at most k samples of each class, the first k of that class in its
    training split's stored order (its test split is untouched); 0 = the whole split. HtFLlib's
    and PFLlib's ``-fs`` (``read_client_data``). The stored order of a split drawn here is a
    permutation drawn from the partition's seed, so the k are a seeded draw per (seed, client); with
    data.partition=pfllib it is the file's order, exactly the samples HtFLlib keeps."""
    domains: list[str] = declared(default_factory=list, identity=ADDED_LATER)
    """Domain shift: the domains of ``dataset`` the clients come from (``[mnist, usps, svhn, syn,
    mnistm]`` of ``digit5``; ``domainnet``'s clipart, infograph, painting, quickdraw, real, sketch),
    all sharing one label space. Client i gets domain i mod D (D = how many are named), each
    domain's samples are split among its own clients by ``partition`` (dirichlet, pathological,
    exdir), and every client's test split comes from its domain. Empty (default): ``dataset``
    as one pool (for a suite, every domain mixed). docs/datasets.md, "Domain shift"."""

    options: dict[str, Any] = declared(default_factory=dict, identity=ADDED_LATER)
    """The dataset's own options, for a source registered with an options dataclass
    (``DatasetSource.options``; a plugin's, e.g. a sequence length or a feature subset): checked
    against it and spelled out by the resolution step, hashed like ``algo.*``, and part of the
    partition cache's key. Empty for a dataset without options (every built-in one)."""

    def check(self) -> None:
        if self.partition == "pfllib" and not self.pfllib_dir:
            raise ConfigError("data.partition=pfllib needs data.pfllib_dir=DIR (a PFLlib dataset directory)")
        if self.partition_rules == "legacy" and (self.partition == "exdir" or self.balance):
            raise ConfigError("data.partition=exdir and data.balance=true are PFLlib's rules and have no legacy "
                              "form; use data.partition_rules=pfllib")
        if self.balance and self.partition != "pathological":
            # the line partition_pfllib.balance_refusal gives
            raise ConfigError(f"config key 'data.balance' is true but data.partition is {self.partition!r}: PFLlib's "
                              f"balance changes only its pat split (data.partition=pathological; its dir and exdir "
                              f"splits are the same either way); leave data.balance false")
