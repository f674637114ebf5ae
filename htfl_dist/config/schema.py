"""The config schema: one dataclass per section, each field with its type, default and rule.

A field's rule is declared where the field is: ``Literal[...]`` for a closed choice (checked
while the value is parsed, ``loading``) and ``bounded(...)`` for a numeric range (checked by
``check_bounds`` with one wording everywhere, algorithm options included). Checks that relate
two fields are a section's ``check()`` (or an options class's ``validate()``). Reading files and
overrides is ``loading``; what makes two configs the same experiment is ``identity``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from htfl_dist.config.data_section import DEFAULT_FMNIST_ROOT, DataConfig, default_cache_dir, partition_cache_dir
from htfl_dist.config.generator_section import GeneratorConfig
from htfl_dist.config.identity import experiment_hash, experiment_view
from htfl_dist.config.participation_section import ParticipationConfig
from htfl_dist.config.privacy_section import PrivacyConfig
from htfl_dist.config.rules import ADDED_LATER, PLUMBING, Bound, Identity, bounded, check_bounds, declared
from htfl_dist.errors import ConfigError, shown

__all__ = [  # re-exported: the schema's own rules and the sections kept in their own modules
    "DEFAULT_FMNIST_ROOT", "Bound", "DataConfig", "PrivacyConfig", "bounded", "check_bounds", "default_cache_dir",
    "partition_cache_dir",
]

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
    options: dict[str, Any] = declared(default_factory=dict, identity=ADDED_LATER)
    """The architectures' own options, for members registered with an options dataclass
    (``register_architecture(..., options=)``; a plugin's, e.g. a hidden width): checked against
    the group's members and spelled out by the resolution step, hashed like ``algo.*``, and handed
    to every ``build_model``. Empty where no member declares options (every built-in one)."""

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
    compile: Literal["off", "default", "reduce-overhead"] = declared("off", identity=ADDED_LATER)
    """``torch.compile`` the clients' forward pass in local training (and, through AOTAutograd, its
    backward): ``default`` (Inductor kernels) or ``reduce-overhead`` (Inductor, replayed as CUDA
    graphs on a GPU, where batch-10 steps of small CNNs wait on kernel launches). Full batches
    only (a trailing partial batch runs eagerly: one graph per architecture); the algorithm's loss
    and the optimiser step stay eager. Each architecture pays its compile on its first step (tens
    of seconds on a CPU, bench/compile_step.py prints it). Off by default: on this project's
    2-core CPU it made a step slower than eager. Fused kernels round differently, so a compiled
    run is another experiment (in the hash; ``off`` is not). Refused with client_batching=vmap and
    privacy.enabled, which train through their own step."""
    cuda_graphs: Literal["auto", "on", "off"] = declared("off", identity=ADDED_LATER)
    """Record each client's full-batch local step (forward, the algorithm's loss, backward, the
    optimisers' step) once per round as a CUDA graph and replay it (htfl_dist/algorithms/
    step_graphs.py): a batch-10 step of a small CNN then costs one launch instead of hundreds.
    auto: where possible (a CUDA device, an algorithm whose step is declared capturable: local,
    fedproto, fedtgp; no privacy, compile or client batching), eager elsewhere, and the run line says
    which; on: as auto, refused in one line where impossible; off: eager. Off by default until
    the GPU suite has shown it equal to eager on a lent GPU (it has not run there yet)."""
    concurrent_clients: int = bounded(1, identity=PLUMBING, at_least=0, note="0 = auto")
    """How many of a rank's participants train at once, each in a thread of its own (on a GPU, on
    a CUDA stream of its own; htfl_dist/runtime/concurrent_training.py): on a GPU, batch-10 steps
    of small CNNs leave it idle between launches, and several clients' steps fill it. 1: one after
    the other; N: up to N at once; 0 (auto): one at a time on a CPU (a rank's thread count is
    ``runtime.threads``; run more ranks instead), on a GPU as many as the measured time per step
    keeps improving (1, 2, 4, 8). Only for algorithms whose client step is declared
    ``trains_concurrently`` (local, fedproto, fedtgp, protonorm); refused with privacy.enabled, train.compile
    and client_batching=vmap. Never changes the results: a model whose training draws from torch's
    global RNG (dropout) trains one at a time (the run says so once), and a draw by a client
    training beside others ends the run naming it."""
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
        if self.compile != "off" and self.client_batching == "vmap":
            raise ConfigError(f"train.compile={self.compile} compiles a client's own forward pass; "
                              f"train.client_batching=vmap trains through a batched one: use one of them")
        if self.concurrent_clients > 1 and (self.client_batching != "off" or self.compile != "off"):
            other = "train.client_batching=vmap" if self.client_batching != "off" else f"train.compile={self.compile}"
            raise ConfigError(f"train.concurrent_clients={self.concurrent_clients} trains clients side by side in "
                              f"threads; {other} cannot run in them: use one of them")
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
    presum_uploads: bool = False
    """Each client rank sums its participants' contributions (exact fixed point, so any world size
    gives the same sum) and rank 0 receives one message per rank, for servers that need only the
    sum (``registry.sums_only``: FedProto, FedDistill, LG-FedAvg, FML, FedMRL; htfl_dist/runtime/
    presum.py). Off: every upload travels to rank 0, which screens each one; on, the numbers equal
    the per-client path's up to float rounding, and the simulated participation is refused."""
    server_hosts_clients: bool = False
    """Rank 0 also hosts and trains clients (placed as any client rank) besides serving, so W
    processes give W training ranks instead of W − 1. For a few ranks sharing a few cores (two
    processes on a 2-core machine train where three took turns) and for servers whose step is
    small next to a round's training. Never changes the results (placement never does). Off: rank
    0 only serves (at W > 1), the better choice when the server's step is heavy (FedTGP, FedKTL)."""
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
    test_set: Literal["local", "global"] = declared("local", identity=ADDED_LATER)
    """local: each client on its own test split (HtFLlib's, PFLlib's). global: every tested client's
    model on the global test set, the union of the N clients' test splits in client-id order
    (FedNH's protocol, whose paper argues that per-client splits bias a personalised method's
    figure under class imbalance); test_acc is then the mean over clients of their accuracy on
    it (FedNH's ``uniform``), beside its two class weightings, ``test_acc_validclass`` (the classes
    the client trains on) and ``test_acc_labeldist`` (weighted by its training labels), in
    metrics.jsonl and per_client.jsonl. Each client's evaluation reads all of it: N times the local
    one's forward passes (``clients_fraction`` thins them)."""
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
    privacy: PrivacyConfig = declared(default_factory=PrivacyConfig,
                                      identity=Identity(omit_unless=("enabled", "secure_aggregation")))
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
