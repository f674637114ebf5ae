"""The config schema: one dataclass per section, each field with its type, default and rule.

A field's rule is declared where the field is: ``Literal[...]`` for a closed choice (checked
while the value is parsed, ``loading``) and ``bounded(...)`` for a numeric range (checked by
``check_bounds`` with one wording everywhere, algorithm options included). Checks that relate
two fields are a section's ``check()`` (or an options class's ``validate()``). Reading files and
overrides is ``loading``; what makes two configs the same experiment is ``identity``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from htfl_dist.config.generator_section import GeneratorConfig
from htfl_dist.config.identity import experiment_hash, experiment_view
from htfl_dist.config.participation_section import ParticipationConfig
from htfl_dist.config.rules import ADDED_LATER, PLUMBING, Bound, Identity, bounded, check_bounds, declared
from htfl_dist.errors import ConfigError, shown

__all__ = ["Bound", "bounded", "check_bounds"]  # re-exported: the schema's own rules

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


@dataclass
class ModelConfig:
    """Heterogeneous model group: client i gets group[i mod len(group)]."""

    group: str = "HtCNN8"
    """A named group (HtCNN8, HtFE8, HtFE8-HtC4, ...), one member ARCH or ARCH:HEAD, or a custom
    group: a YAML list of members, or the same members comma-separated (a list is stored in that
    comma form, so both spellings are one experiment)."""
    feature_dim: int = bounded(512, at_least=1, at_most=1 << 16, note="wider than any model's features")
    init: Literal["per_client", "htfllib"] = declared("per_client", identity=ADDED_LATER)
    """per_client: client i's initial weights come from a stream keyed by (seed, client i), so no
    two clients start alike. htfllib: as HtFLlib's clients, torch's RNG is set to ``seed`` before
    each client's model is built (HtFLlib always uses 0), so clients of the same architecture
    start with identical weights and different architectures share their first draws; the
    architecture's own ``Linear(K, C)`` is drawn and replaced by a freshly drawn head, as
    HtFLlib's BaseHeadSplit does. With seed 0 this is HtFLlib's initial model, bit for bit,
    wherever our architecture draws its parameters in HtFLlib's order (checked for HtCNN8)."""
    pretrained: str | None = declared(None, identity=Identity(added_later=True, location=True))
    """A directory of pre-trained weights, one ``torch.save``-d state dict per architecture
    (``ARCH.pt``; with ``pretrained_part: whole`` and a head other than the architecture's own,
    ``ARCH+HEAD.pt``), loaded into every client's freshly built model before its first round
    (htfl_dist/models/pretrained.py, docs/datasets.md). Unset: every model from scratch. Like
    ``data.root``, where the directory is is not part of the experiment (that one is set is);
    checkpoints record each file's sha256 and a resume on other files is refused."""
    pretrained_part: Literal["features", "whole"] = declared("features", identity=ADDED_LATER)
    """What ``pretrained`` replaces: the feature extractor (the head stays as ``init`` drew it, its
    class count being the data's), or the whole model (feature_extractor.* and head.*)."""

    LIST_KEYS = ("group",)  # not a field: keys that also accept a YAML list of strings

    def check(self) -> None:
        """An empty ``pretrained`` is unset; ``pretrained_part`` means nothing without it (and would
        change the hash alone), so it is refused there, as unused train options are."""
        if not self.pretrained:
            self.pretrained = None
        if self.pretrained is None and self.pretrained_part != "features":
            raise ConfigError(f"config key 'model.pretrained_part' applies with model.pretrained=DIR; leave it "
                              f"unset (got {shown(self.pretrained_part)})")


@dataclass
class TrainConfig:
    """Client-side optimisation (the papers' defaults)."""

    batch_size: int = bounded(10, at_least=1)
    lr: float = bounded(0.01, above=0)
    local_epochs: int = bounded(1, at_least=1)
    batch_order: Literal["shuffled", "fixed"] = declared("shuffled", identity=ADDED_LATER)
    """shuffled: every local epoch visits the client's training split in a fresh permutation drawn
    from the (seed, client, round) batch stream; fixed: in the split's stored order, the same
    batches every epoch and every round, as HtFLlib's client loader (``shuffle=False``) does.
    With data.partition=pfllib the stored order is the order of the PFLlib file."""
    last_batch: Literal["keep", "drop"] = declared("keep", identity=ADDED_LATER)
    """What happens to an epoch's trailing partial batch. keep: it trains like any other, except a
    batch of a single sample (BatchNorm cannot train on it); drop: it is left out, as HtFLlib's
    client loader (``drop_last=True``) does, so a client with fewer samples than one batch does
    not train (nor collect prototypes while training)."""
    client_batching: Literal["off", "vmap"] = declared("off", identity=ADDED_LATER)
    """off: each participant trains alone, one after the other. vmap: the participants of one
    architecture hosted on a rank train as one batched model (``torch.func.vmap`` over their
    stacked parameters), each with its own batches and step count, equal to ``off`` within float
    tolerance (world-size invariant within it, not bit for bit). On a GPU, batch-10 steps of
    small CNNs are bound by kernel launches, which the group shares; on a CPU they are bound by
    arithmetic and it does not pay. Only for algorithms with a batched client path (local,
    fedproto, fedtgp) and models without BatchNorm or Dropout; anything else is refused at
    start-up. Changes the config hash (``off`` does not)."""
    max_diverged_rounds: int = bounded(3, identity=PLUMBING, at_least=0, note="0 = never give up")
    """A run in which every participating client's loss is not finite (NaN or infinite: the
    learning rate is too large for the model) this many rounds in a row ends with one line and
    status 1; the rounds in between are not checkpointed, so the last checkpoint is a good one.
    Not part of the experiment (it decides when to give up, not what a round computes)."""
    optimizer: Literal["sgd", "adam", "adamw"] = declared("sgd", identity=ADDED_LATER)
    """The client's optimizer (``torch.optim.SGD``, ``Adam``, ``AdamW``; Adam's betas and eps are
    torch's defaults), built in one place (``algorithms.optimizers``) and kept with the client
    across rounds: its state (momentum, Adam's moments) is checkpointed and parked with it."""
    momentum: float = bounded(0.0, identity=ADDED_LATER, at_least=0, below=1)
    """SGD's momentum (torch's form: dampening 0, no Nesterov); sgd only."""
    weight_decay: float = bounded(0.0, identity=ADDED_LATER, at_least=0)
    """L2 weight decay as torch applies it: added to the gradient (sgd, adam) or decoupled (adamw)."""
    lr_schedule: Literal["constant", "exponential", "step", "cosine"] = declared("constant", identity=ADDED_LATER)
    """The client learning rate of round r (0-based), a function of the config and r alone, set on
    the client's optimizer before it trains: constant ``lr``; exponential ``lr``·γ^r (γ =
    ``lr_decay``; HtFLlib's/PFLlib's ``-ld True -ldg γ``); step ``lr``·γ^⌊r / lr_step_rounds⌋;
    cosine ``lr_min`` + (``lr`` − ``lr_min``)·(1 + cos(π·r / rounds))/2 over the run's ``rounds``
    (which then becomes part of the experiment: such a run cannot be extended on resume)."""
    lr_decay: float = bounded(0.99, identity=ADDED_LATER, above=0, at_most=1)
    """γ, the factor per round (exponential) or per ``lr_step_rounds`` rounds (step); HtFLlib's
    ``-ldg`` (default 0.99 there too)."""
    lr_step_rounds: int = bounded(0, identity=ADDED_LATER, at_least=0, note="0 = unset; lr_schedule=step needs it")
    """step: the lr is multiplied by ``lr_decay`` every this many rounds (torch's StepLR step_size)."""
    lr_min: float = bounded(0.0, identity=ADDED_LATER, at_least=0)
    """cosine: the lr the schedule reaches at round ``rounds`` (torch's CosineAnnealingLR eta_min)."""

    def check(self) -> None:
        """Options that only one optimizer or schedule reads are refused elsewhere, since they would
        change the config hash and nothing else; the batched client step is plain SGD only."""
        if self.momentum and self.optimizer != "sgd":
            raise ConfigError(f"config key 'train.momentum' applies to train.optimizer=sgd, not {self.optimizer} "
                              f"(Adam's betas are torch's defaults); leave it at 0")
        uses = {"lr_decay": ("exponential", "step"), "lr_step_rounds": ("step",), "lr_min": ("cosine",)}
        defaults = {item.name: item.default for item in dataclasses.fields(self)}
        for key, schedules in uses.items():
            if getattr(self, key) != defaults[key] and self.lr_schedule not in schedules:
                raise ConfigError(f"config key 'train.{key}' applies to train.lr_schedule="
                                  f"{' or '.join(schedules)}, not {self.lr_schedule}; leave it unset")
        if self.lr_schedule == "step" and self.lr_step_rounds < 1:
            raise ConfigError("train.lr_schedule=step needs train.lr_step_rounds=N (the lr is multiplied by "
                              "train.lr_decay every N rounds)")
        if self.lr_schedule == "cosine" and self.lr_min >= self.lr:
            raise ConfigError(f"config key 'train.lr_min' must be below train.lr ({shown(self.lr)}) for "
                              f"train.lr_schedule=cosine, got {shown(self.lr_min)}")
        if self.client_batching == "vmap" and (self.optimizer != "sgd" or self.momentum or self.weight_decay):
            raise ConfigError("train.client_batching=vmap steps plain SGD (p <- p - lr*g) and keeps no optimizer "
                              "state: it takes train.optimizer=sgd without momentum or weight decay; use "
                              "train.client_batching=off")


@dataclass
class RuntimeConfig:
    """Process and device plumbing; never changes the maths."""

    backend: Literal["auto", "gloo", "nccl", "mpi"] = "auto"
    """auto: mpi under mpirun, nccl if every rank owns a GPU, else gloo."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = bounded(0, at_least=0)
    """torch intra-op threads per rank (0 = torch default). Equal thread counts give bitwise
    equal results across world sizes on CPU."""
    timeout_s: float = bounded(600.0, above=0)
    """A collective that waits longer than this aborts the job."""
    heartbeat_timeout_s: float = bounded(30.0, at_least=0, note="0 = off")
    """Gloo/NCCL: every rank beats through the rendezvous store; a rank silent this long (dead,
    stopped, cut off) ends the job with one line naming it and its clients (0 = off). MPI has no
    store: there the round deadline names the rank rank 0 waited for."""
    round_deadline_s: float = bounded(3600.0, at_least=0, note="0 = none")
    """A round that takes longer than this on any rank ends the job (0 = no deadline). The
    safety net against a hung peer, also under MPI, which has no collective timeout."""
    preempt_grace_s: float = bounded(120.0, above=0)
    """After SIGTERM, the job checkpoints at the next round boundary; past this it exits anyway."""
    placement: Literal["balanced", "round_robin"] = "balanced"
    """balanced: clients onto client ranks by estimated work (``placement_work``), largest first,
    each to the least loaded rank; round_robin: client i on rank 1 + i mod (W − 1). Never changes
    the results."""
    rebalance: Literal["round", "off"] = "round"
    """round: each round, participants move from the busiest client rank to the idlest while that
    shortens the round (``placement.round_trainers``: the largest that fits first), their state
    lent for the round and given back before evaluation, so a sample that falls unevenly on the
    home ranks still ends together; off: every client trains on its home rank. Never changes the
    results (the lent state is the parked record; streams are keyed by client)."""
    placement_work: Literal["timed", "samples", "flops"] = "timed"
    """What balanced placement weighs a client by. ``timed``: its local steps per round times one
    training step of its architecture, which rank 0 times at start-up on its device (about a
    second for HtCNN8 on a CPU; every rank receives the figures; nothing is timed with one client
    rank). ``samples``: its training samples. ``flops``: its samples times its architecture's
    forward FLOPs per sample (counted on the meta device). On the 2-core VM the members of HtCNN8
    differ up to 2x in step time at equal sample counts, and timed placement left 1-2 % idle
    where samples left 9 % (bench/placement.py). Never changes the results; with
    ``train.client_batching=vmap`` groups follow placement, so there it holds within float
    tolerance, and timed placement may differ from run to run (use ``samples`` for bit-equal
    reruns)."""
    resident_clients: int = bounded(0, at_least=0, note="0 = all")
    """At most this many of a rank's clients stay in memory; the least recently used others are
    parked (to ``client_scratch_dir`` on disk when computing on the CPU, to host memory on a GPU)
    and come back bit for bit when next needed (0 = all stay resident). For runs with many more
    clients than take part in a round (1000 clients at ρ = 0.1). Never changes the results."""
    client_scratch_dir: str | None = None
    """Where a CPU rank parks clients (a private directory is made inside and removed at the end;
    None: the system's temporary directory, $TMPDIR, usually node-local)."""
    gpu_memory_gib: float = bounded(0.0, at_least=0, note="0 = no cap")
    """The most GPU memory this rank's PyTorch allocator may hold on its device, in GiB (0 = no
    cap). Runs sharing a GPU (a study's ``--gpu-memory-per-cell``) each stay inside their share:
    one that outgrows it fails alone with PyTorch's out-of-memory error instead of starving the
    others. The CUDA context (a few hundred MiB) comes on top."""
    max_message_mb: float = bounded(1024.0, above=0)
    """Largest message rank 0 accepts from one client rank per gather (checked before allocating
    it); raise it only for shared models larger than this."""

    def check(self) -> None:
        if 0 < self.heartbeat_timeout_s < HEARTBEAT_FLOOR_S:
            raise ConfigError(
                f"config key 'runtime.heartbeat_timeout_s' must be 0 (off) or at least {HEARTBEAT_FLOOR_S:g} "
                f"(ranks beat once a second, and a busy machine delays a beat; less declares healthy ranks "
                f"dead), got {shown(self.heartbeat_timeout_s)}")


HEARTBEAT_FLOOR_S = 3.0
"""The shortest silence that may end a job: three of the one-second heartbeats."""


@dataclass
class StopConfig:
    """Early stopping: end the run once ``metric`` has not improved by more than ``min_delta`` for
    ``patience`` evaluated rounds (HtFLlib's -ab auto-break with -tc N is patience N, min_delta
    0). Not part of the experiment: it decides when to stop, not what a round computes; the count
    is derived from metrics.jsonl, so a resumed run keeps it."""

    patience: int = bounded(0, at_least=0, note="0 = never stop early")
    """Evaluated rounds without an improvement after which the run ends (0: it runs all ``rounds``)."""
    min_delta: float = bounded(0.0, at_least=0)
    """The smallest change that counts as an improvement."""
    metric: Literal["test_acc", "test_acc_head", "train_loss"] = "test_acc"
    """What must improve: accuracies upwards, the training loss downwards."""


@dataclass
class EvalConfig:
    """Which clients an evaluation round tests. With thousands of clients, testing every one each
    evaluated round costs more than the round's training; a seeded share keeps the rows cheap and
    comparable, and the last round always tests everyone."""

    clients_fraction: float = bounded(1.0, above=0, at_most=1)
    """The share of the N clients tested on an evaluation round: int(N·f) of them (at least one),
    drawn from (seed, round), every one on the run's last round."""
    new_clients: int = bounded(0, identity=ADDED_LATER, at_least=0)
    """M clients held out of the federation (PFLlib's ``-nnc``): the data are split among N + M
    clients and clients N..N+M−1 never train in a round nor upload. On every evaluation round each
    starts again from its initial model, receives that round's download, trains
    ``new_client_epochs`` local epochs with the algorithm's own client step and is tested: how
    well the federation's knowledge serves a newcomer (``new_client_acc`` beside ``test_acc``)."""
    new_client_epochs: int = bounded(1, identity=ADDED_LATER, at_least=1)
    """The local epochs an unseen client trains before its test (PFLlib's ``-ften``), at
    ``train.lr`` whatever ``train.lr_schedule`` gives the federation's clients that round."""


@dataclass
class OutputConfig:
    """What a run writes and prints besides metrics.jsonl and summary.json; never changes the maths."""

    tensorboard: bool = False
    """Rank 0 writes TensorBoard scalars per evaluated round under RUN/tensorboard/ (needs the
    ``tensorboard`` package: ``pip install -e .[tensorboard]``)."""
    htfllib_h5: bool = False
    """Rank 0 keeps RUN/<dataset>_<algorithm>_test_<seed>.h5 with HtFLlib's result arrays
    (``rs_test_acc``, ``rs_train_loss``), rewritten after every evaluated round, so plotting
    scripts written for HtFLlib read our runs."""
    mlflow: bool = False
    """Rank 0 keeps an MLflow tracking run of this run: the config as params, every row as metrics at
    step = round, summary and plots as artifacts (``pip install -e .[mlflow]``; docs/running.md)."""
    mlflow_uri: str | None = None
    """Where the MLflow runs go: a tracking URI (``http://host:5000``, ``sqlite:///FILE``) or a
    directory for a file store; None: RUN/mlruns (a study's cells: STUDY/mlruns, one store)."""
    wandb: bool = False
    """Rank 0 keeps a Weights & Biases run of this run, under RUN/wandb (``pip install -e .[wandb]``)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: nothing leaves the machine until ``wandb sync RUN/wandb/offline-run-*``; online:
    logs to the W&B server as the run goes (needs ``wandb login``)."""
    wandb_project: str = "htfl_dist"
    """The W&B project the run belongs to."""
    tracking_group: str | None = None
    """The MLflow experiment and W&B group of the run (None: ``htfl_dist`` for MLflow, no group for
    W&B); a study sets its title, so its cells and seeds sit together."""
    tracking_name: str | None = None
    """The tracking run's name (None: the run directory's name); a study sets the cell's name."""
    progress_every_s: float = bounded(30.0, at_least=0, note="0 = never")
    """A rank whose clients are still training this many seconds into a round prints how many
    it has done (0 = never)."""
    prototypes_every: int = bounded(0, at_least=0, note="0 = never")
    """Every this many rounds rank 0 keeps the round's uploaded prototypes and the global class
    vectors it sends down in RUN/prototypes/round_NNNNN.pt, for ``python -m htfl_dist.report RUN
    --prototypes FILE.png`` (0 = never; only for algorithms that send class prototypes)."""


@dataclass
class PrivacyConfig:
    """Record-level (ε, δ) differential privacy of each client's training samples against everyone
    who sees its uploads (docs/privacy.md): DP-SGD local training (Opacus) and Gaussian noise on
    the released class rows, one accountant per client. Off by default; while off the section is
    not part of the experiment (it changes nothing)."""

    enabled: bool = False
    target_epsilon: float = bounded(4.0, above=0, note="the budget each client may spend")
    """ε each client may spend over the run; the one noise multiplier of every mechanism is
    calibrated up front so that ``planned_rounds`` full rounds spend at most this."""
    delta: float = bounded(1e-5, above=0, below=1)
    """δ of the guarantee (well below 1 / the samples a client holds)."""
    planned_rounds: int | None = bounded(None, at_least=1, optional=True, note="or null: rounds")
    """Rounds the noise is calibrated for (null: ``rounds`` of the run's first start; the
    multiplier is then kept in the checkpoints, so extending ``rounds`` on resume does not
    re-calibrate: clients stop uploading when their budget is spent)."""
    feature_clip: float = bounded(1.0, above=0, note="S")
    """S: every sample's row (feature or logit vector) is scaled to L2 norm at most S before the
    class mean is taken."""
    max_grad_norm: float = bounded(1.0, above=0, note="C")
    """C: DP-SGD's per-sample gradient clipping norm."""
    min_class_samples: int = bounded(10, at_least=1)
    """A class with fewer training samples than this is not uploaded (its mean would be mostly
    noise: the noise's scale is 2·S·σ / n_c)."""
    accountant: Literal["rdp", "prv"] = "rdp"
    """Opacus's accountant composing every release: rdp (Rényi DP, an upper bound) or prv
    (privacy random variables, a tighter numerical estimate)."""
    noise: Literal["secure", "seeded"] = "secure"
    """Where every Gaussian draw of the mechanisms comes from. secure: the operating system's
    cryptographically secure source, which no other party (the server included) can reproduce;
    the runs' numbers then differ from run to run. seeded: streams keyed by (seed, client, round,
    release), reproducible bit for bit, for experiments only: anyone who knows the config's seed
    can regenerate the noise and subtract it, so such a run is not private against the server."""


NUMPY_SEED_MAX = 2**32 - 1
"""The largest seed numpy's ``RandomState`` accepts."""


@dataclass
class Config:
    """One federated run."""

    algorithm: str = "fedproto"
    rounds: int = bounded(100, identity=PLUMBING, at_least=1)
    seed: int = 0
    num_clients: int = bounded(20, at_least=1, at_most=1_000_000, note="no dataset here has more samples")
    join_ratio: float = bounded(1.0, above=0, at_most=1)
    eval_every: int = bounded(1, identity=PLUMBING, at_least=1)
    checkpoint_every: int = bounded(0, identity=PLUMBING, at_least=0, note="0 = never")
    checkpoint_keep: int = bounded(2, identity=PLUMBING, at_least=1)
    """How many complete checkpoints to keep (older ones are deleted after a new one is published)."""
    on_bad_upload: Literal["skip", "fail"] = declared("skip", identity=PLUMBING)
    """skip: an invalid upload (shape, dtype, NaN/Inf, class ids) is left out of that round with a
    warning naming the client; fail: it ends the job."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = declared(default_factory=RuntimeConfig, identity=PLUMBING)
    output: OutputConfig = declared(default_factory=OutputConfig, identity=PLUMBING)
    eval: EvalConfig = declared(default_factory=EvalConfig, identity=Identity(omit_when_default=True))
    stop: StopConfig = declared(default_factory=StopConfig, identity=PLUMBING)
    """Early stopping (``stop.patience``); off by default."""
    """Sampled evaluation for large federations (``eval.clients_fraction``); all clients by default."""
    generator: GeneratorConfig = declared(default_factory=GeneratorConfig, identity=Identity(omit_when_default=True))
    """The server's pre-trained generator (FedKTL; htfl_dist/generators)."""
    privacy: PrivacyConfig = declared(default_factory=PrivacyConfig, identity=Identity(omit_unless="enabled"))
    """Differential privacy of what leaves a client (docs/privacy.md); off by default."""
    participation: ParticipationConfig = declared(default_factory=ParticipationConfig,
                                                  identity=Identity(omit_when_default=True))
    """Drop-out, slow clients, deadlines and random participation on a simulated clock; off by default."""
    algo: dict[str, Any] = field(default_factory=dict)
    """Options of the chosen algorithm as written: the form that is stored (config.yaml, the
    checkpoints) and hashed. The resolution step (``htfl_dist.resolution``) checks it against the
    algorithm's options dataclass and spells every option out."""
    plugins: list[str] = declared(default_factory=list, identity=PLUMBING)
    """Modules imported before any name is resolved, so that what they register (algorithms,
    architectures, model groups, datasets, generators) can be named here; a study's cells inherit
    them from their config. Not part of the experiment's hash (declared plumbing)."""

    def check(self) -> None:
        """PFLlib's rules draw the split from numpy's ``RandomState``, which takes a seed in
        0..2**32 - 1; the key named is the one that seeds the split (``data.partition_seed`` when
        set, else ``seed``), so the line points at what to change."""
        if self.data.partition_rules != "pfllib" or self.data.partition == "pfllib":
            return
        key, value = (("data.partition_seed", self.data.partition_seed) if self.data.partition_seed is not None
                      else ("seed", self.seed))
        if not 0 <= value <= NUMPY_SEED_MAX:
            raise ConfigError(f"config key '{key}' is {value}; data.partition_rules=pfllib seeds numpy's "
                              f"RandomState, which takes 0..{NUMPY_SEED_MAX}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def experiment(self) -> dict[str, Any]:
        """The keys that define the experiment's maths (what a resumed run must not change)."""
        return experiment_view(self.to_dict(), type(self))

    def config_hash(self) -> str:
        """Hash of the maths-relevant config, for summaries and checkpoints: two runs with equal
        hashes compute the same rounds (runtime plumbing and the run length are excluded)."""
        return experiment_hash(self.experiment())
