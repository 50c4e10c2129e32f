"""TrainConfig: every knob of the training stage, validated before anything starts.

The config is a plain pydantic model, so the same object travels from the driver to every
worker as JSON (``cfg.model_dump_json()``) whichever launcher runs them.

Algorithm selection is open-ended: ``algorithm.name`` is looked up in
``pipeline.train.algorithms.REGISTRY`` and ``algorithm.params`` is validated against that
algorithm's own ``Params`` model, so a new algorithm needs a new file plus one registry line
and no change here (the ``--help`` text lists the registry).

``debug`` holds switches for tests and fault-injection drills only (never needed by a real
run): a digest of the parameters after every step, and a simulated crash at a given step.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import StageConfig
from ..errors import ConfigError
from .algorithms import names as algorithm_names
from .stragglers import SimClockConfig, StragglerConfig

class AlgorithmConfig(BaseModel):
    """Which algorithm, with its own parameters (see each module's ``Params``)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("arsgd", description=" | ".join(algorithm_names()))
    params: dict[str, Any] = Field(default_factory=dict, description="parameters of the chosen algorithm")

    @model_validator(mode="after")
    def _known(self):
        from .algorithms import validate_params

        validate_params(self.name, self.params)  # raises ConfigError naming the value
        return self


class PolicyConfig(BaseModel):
    """What parameter averaging does with BatchNorm running statistics and optimizer momentum.

    * ``batchnorm``: ``average`` (running mean/var are averaged together with the weights, and
      before every evaluation) or ``local`` (each worker keeps its own; evaluation uses the
      world average of the weights with rank-local statistics).
    * ``momentum``: ``local`` (keep each worker's buffer), ``average`` (average it with the
      weights) or ``reset`` (zero it after each averaging). Applies to SGD's momentum buffer
      and Adam's two moment estimates.
    """

    model_config = ConfigDict(extra="forbid")
    batchnorm: Literal["average", "local"] = Field("average", description="BatchNorm buffers at averaging: average|local")
    momentum: Literal["local", "average", "reset"] = Field("local", description="optimizer momentum at averaging: local|average|reset")


class TrackingConfig(BaseModel):
    """MLflow tracking of a run (``pipeline.studies.tracking``; off by default for plain training)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(False, description="log params, metrics and the learning curve to MLflow")
    uri: Optional[str] = Field(None, description="tracking URI (default: file store mlruns/ next to the output)")
    experiment: Optional[str] = Field(None, description="MLflow experiment (default: train, or the study name)")


def _read_profile(path: str) -> dict:
    """``compute_step_s`` and ``compute_source`` of a compute-profile file (one line naming the key and
    the file when it is not one)."""
    from ..config import read_yaml

    try:
        data = read_yaml(path)      # a missing file, bad YAML or no mapping
    except ConfigError as e:
        raise ConfigError(f"invalid config value cluster.compute_profile={path!r}: {e}") from None
    if not isinstance(data.get("compute_step_s"), dict) or not str(data.get("compute_source") or "").strip():
        raise ConfigError(f"cluster.compute_profile={path!r}: a compute profile needs compute_step_s (local batch: "
                          "seconds) and compute_source")
    return {"compute_step_s": data["compute_step_s"], "compute_source": data["compute_source"]}


class ClusterConfig(BaseModel):
    """The cluster a run is costed on by the cost model (``pipeline.train.comm.costmodel``):
    nodes, ranks per node, and the latency and bandwidth of the links between and inside nodes, from a
    preset or given. Unset (the default): every collective and message costs ``simulated_clock``'s
    ``latency_s + bytes / bytes_per_s``, as before the cluster model."""

    model_config = ConfigDict(extra="forbid")
    preset: Optional[str] = Field(None, description="link technology: gbe1 | gbe10 | ib100 | nvlink (numbers and "
                                                    "sources in docs/training.md); the fields below override it")
    nodes: Optional[int] = Field(None, gt=0, description="nodes (default 1)")
    ranks_per_node: Optional[int] = Field(None, gt=0, description="ranks per node, placed in blocks (default: "
                                                                  "workers / nodes, rounded up)")
    inter_latency_s: Optional[float] = Field(None, ge=0, allow_inf_nan=False, description="latency between nodes")
    inter_bytes_per_s: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="bandwidth between "
                                                                                             "nodes (bytes/s)")
    intra_latency_s: Optional[float] = Field(None, ge=0, allow_inf_nan=False, description="latency inside a node")
    intra_bytes_per_s: Optional[float] = Field(None, gt=0, allow_inf_nan=False, description="bandwidth inside a "
                                                                                             "node (bytes/s)")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="whose collective algorithms are costed")
    allreduce: Literal["auto", "ring", "tree", "hierarchical"] = Field(
        "auto", description="auto: what the backend picks (gloo: ring; nccl: the cheaper of ring and tree) | ring | "
                            "tree (nccl) | hierarchical (Horovod: inside nodes, across nodes, inside nodes)")

    compute_step_s: Optional[dict[int, float]] = Field(
        None, description="compute profile: seconds of one training step per local batch size, measured on this "
                          "machine (compute_profile.measure_profile) or given for named hardware; the run's step takes "
                          "its local batch's time (linear between two given sizes) unless simulated_clock.step_s "
                          "is set")
    compute_source: Optional[str] = Field(None, description="where compute_step_s comes from (required with it)")
    compute_profile: Optional[str] = Field(None, description="a YAML file of compute_step_s and compute_source (a "
                                                             "measured profile, configs/clusters/profiles/); "
                                                             "compute_step_s given here wins")

    @model_validator(mode="before")
    @classmethod
    def _profile_file(cls, data):
        if isinstance(data, dict) and isinstance(data.get("compute_profile"), str) and data["compute_profile"] \
                and data.get("compute_step_s") is None:     # another type: the field's own check names it
            data = {**data, **_read_profile(str(data["compute_profile"]))}
        return data

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.preset, self.nodes, self.ranks_per_node, self.inter_latency_s,
                                           self.inter_bytes_per_s, self.intra_latency_s, self.intra_bytes_per_s,
                                           self.compute_step_s))

    def profile(self):
        """The :class:`~.comm.compute_profile.ComputeProfile` of ``compute_step_s`` (None when unset)."""
        from .comm.compute_profile import ComputeProfile

        if self.compute_step_s is None:
            return None
        try:
            return ComputeProfile(dict(self.compute_step_s), self.compute_source or "")
        except ValueError as e:
            raise ConfigError(f"invalid config value cluster.compute_step_s={self.compute_step_s}: {e}") from None

    def step_seconds(self, local_batch: int) -> float:
        """A step's seconds at the run's local batch from the compute profile; one line outside it."""
        try:
            return self.profile().seconds(local_batch)
        except ValueError as e:
            raise ConfigError(f"invalid config value cluster.compute_step_s={self.compute_step_s}: {e}") from None

    @model_validator(mode="after")
    def _valid(self):
        from .comm.costmodel import PRESETS

        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"invalid config value cluster.preset={self.preset!r}: one of {', '.join(PRESETS)}")
        if self.enabled and self.preset is None:
            missing = [k for k in ("inter_latency_s", "inter_bytes_per_s") if getattr(self, k) is None]
            if missing:
                raise ConfigError(f"invalid config value cluster.{missing[0]}=None: without a preset the cluster "
                                  f"needs inter_latency_s and inter_bytes_per_s")
        if self.compute_step_s is not None and not (self.compute_source or "").strip():
            raise ConfigError(f"invalid config value cluster.compute_step_s={self.compute_step_s}: needs "
                              "cluster.compute_source, where the numbers come from")
        self.profile()
        if self.allreduce == "tree" and self.backend != "nccl":
            raise ConfigError("invalid config value cluster.allreduce='tree': needs cluster.backend='nccl' (gloo's "
                              "allreduce is a ring)")
        return self

    def resolve(self, world: int):
        """The :class:`~.comm.costmodel.Cluster` of a run of ``world`` ranks (None when unset)."""
        from .comm.costmodel import Cluster, Link, preset

        if not self.enabled:
            return None
        nodes = self.nodes or 1
        per_node = self.ranks_per_node or -(-int(world) // nodes)
        if nodes * per_node < int(world):
            raise ConfigError(f"invalid config value cluster.ranks_per_node={per_node}: {nodes} nodes x {per_node} "
                              f"ranks hold fewer than the run's {world} workers")
        base = preset(self.preset) if self.preset else None
        inter = Link(self.inter_latency_s if self.inter_latency_s is not None else base.inter.latency_s,
                     self.inter_bytes_per_s if self.inter_bytes_per_s is not None else base.inter.bytes_per_s)
        intra_default = base.intra if base else inter
        intra = Link(self.intra_latency_s if self.intra_latency_s is not None else intra_default.latency_s,
                     self.intra_bytes_per_s if self.intra_bytes_per_s is not None else intra_default.bytes_per_s)
        return Cluster(nodes, per_node, inter, intra, backend=self.backend, allreduce_algorithm=self.allreduce)


class LoaderConfig(BaseModel):
    """How a worker reads its shard (``pipeline.data.shard_reader.ShardReader``)."""

    model_config = ConfigDict(extra="forbid")
    engine: Literal["native", "petastorm"] = Field(
        "native", description="native: pyarrow engines (mode) | petastorm: Petastorm's make_batch_reader (needs the "
                              "[petastorm] extra)")
    mode: Literal["auto", "memory", "stream"] = Field(
        "auto", description="native engine: memory: decode the shard once, reshuffle in memory | stream | auto: "
                            "memory when it fits")
    memory_budget_mb: Optional[float] = Field(
        None, gt=0, description="auto mode: largest decoded shard kept in memory (default: a fraction of free memory)")
    decode_threads: Optional[int] = Field(None, gt=0, description="parallel decoding threads when streaming")
    prefetch: int = Field(2, ge=0, description="batches prefetched to the device on a background thread (CUDA)")


class DebugConfig(BaseModel):
    """Test and fault-injection switches (off by default; no real run needs them)."""

    model_config = ConfigDict(extra="forbid")
    record_param_digests: bool = Field(False, description="return a digest of each rank's parameters after every step")
    fail_at_step: Optional[int] = Field(None, gt=0, description="simulate a crash right after this step")
    fail_rank: Optional[int] = Field(None, ge=0, description="only this rank crashes (default: every rank)")
    fail_mode: Literal["raise", "kill", "hang", "type_error"] = Field(
        "raise", description="raise: RuntimeError in the worker | kill: the worker process is SIGKILLed | "
                             "hang: the worker blocks for good (what a deadlock looks like) | "
                             "type_error: a TypeError (an error in the code: not restarted)")


class TrainConfig(StageConfig):
    """Configuration of the training stage (``jobs/train.py``, ``pipeline.train.launch.train``)."""

    manifest: str = Field("runs/hep/shards/manifest.json", description="shard manifest.json written by the shard stage")
    output: str = Field("runs/hep/train", description="output directory: metrics.jsonl, summary.json, model.pt")
    checkpoint_dir: Optional[str] = Field(None, description="checkpoints (default: <output>-checkpoints next to output)")
    launcher: Literal["horovod", "torch", "local", "inprocess"] = Field(
        "horovod", description="horovod (horovod.spark.run, gloo) | torch (TorchDistributor) | local (no Spark) | "
                               "inprocess (the workers as ranks on threads of one process; a run that depends on time "
                               "under a deterministic simulated clock, simulated_clock)")
    workers: Optional[int] = Field(None, gt=0, description="number of workers; default and must-match: the manifest's")
    torch_local_mode: bool = Field(False, description="TorchDistributor local_mode (processes on the driver)")
    model: Literal["lenet5", "lenet5_bn", "resnet20", "hlf", "gru", "inclusive"] = Field(
        "lenet5", description="model (when none is given: hlf for shards of HEP features)")
    scaling: Optional[str] = Field(None, description="scaling.json for HEP features (default: next to the manifest's source)")
    epochs: int = Field(8, gt=0, description="target epochs E_target (overlap layouts run ceil(E/C) passes)")
    batch_size: int = Field(32, gt=0, description="the batch that batch_rule reads: local - a worker's batch b | "
                                                  "global - the global batch B (each worker B / M) | household - "
                                                  "the effective batch B_e of Eq. A.3 (Haland & Birkeland 2020)")
    batch_rule: Literal["local", "global", "household"] = Field(
        "local", description="how batch_size becomes a worker's batch: local | global | household (Eq. A.3: "
                             "B_e L_W H / (M (H + L_W - 1)), hierarchical algorithm on a households layout)")
    optimizer: Literal["sgd", "adam", "lars"] = Field(
        "adam", description="base optimizer: sgd (with momentum) | adam | lars (SGD with momentum and layer-wise "
                            "trust ratios, You et al. 2017)")
    lr: float = Field(0.001, gt=0, description="base learning rate (per worker batch, before scaling)")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD and LARS momentum")
    nesterov: bool = Field(False, description="Nesterov momentum for SGD")
    weight_decay: float = Field(0.0, ge=0, description="weight decay (L2 penalty added to the gradient)")
    lars_eta: float = Field(0.001, gt=0, description="LARS trust coefficient eta")
    init: Literal["default", "he"] = Field(
        "default", description="weight initialisation: default (torch's) | he (He et al. 2015: normal, std "
                               "sqrt(2 / fan_in), for every convolution and linear layer; biases 0)")
    lr_scaling: Literal["linear", "none", "household"] = Field(
        "linear", description="scaled rate after the warmup: linear - lr * workers (Goyal et al.) | none | "
                              "household - lr * L_W H / (H + L_W - 1) (E3.2.3)")
    warmup_epochs: float = Field(1.0, ge=0, description="gradual warmup from lr to the scaled lr, in epochs")
    warmup_optimizer: Literal["none", "sgd"] = Field(
        "none", description="sgd: the warmup epochs are plain gradient descent with the rate rising to warmup_lr, "
                            "then optimizer=adam takes over (the two-stage warmup of Wongpanich et al. 2020)")
    warmup_lr: Optional[float] = Field(None, gt=0, description="peak rate of the gradient-descent warmup stage "
                                                               "(warmup_optimizer=sgd)")
    lr_decay_at: list[float] = Field(default_factory=list, description="step decay: fractions of the run's steps at "
                                     "which the rate is multiplied by lr_decay_factor (He et al.: [0.5, 0.75])")
    lr_decay_factor: float = Field(0.1, gt=0, le=1, description="step decay factor")
    augment: Literal["none", "crop_flip"] = Field(
        "none", description="image augmentation of the training batches: crop_flip - pad 4, random crop to the "
                            "image size, horizontal flip with probability 0.5 (He et al. 2016)")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    bucket_mb: float = Field(4.0, gt=0, description="gradient/parameter fusion bucket size (MiB)")
    seed: int = Field(0, description="seed of model init, shuffling and everything random")
    shuffle_buffer: int = Field(2048, ge=0, description="rows in the seeded shuffling buffer of each reader")
    loader: LoaderConfig = Field(default_factory=LoaderConfig, description="how each worker reads its shard")
    eval_every: Optional[int] = Field(None, gt=0, description="validate every N steps (default ceil(N_train/B_global))")
    eval_split: Literal["val", "test"] = Field("val", description="split evaluated during training (test at the end)")
    max_steps: Optional[int] = Field(None, gt=0, description="stop after this many steps (quick runs)")
    checkpoint_every: int = Field(0, ge=0, description="checkpoint every K steps (0: only at the end)")
    resume: Union[bool, Literal["auto"]] = Field(
        False, description="continue from the newest checkpoint in checkpoint_dir; auto: only when one of the same "
                           "config exists (else start fresh)")
    fresh_start: bool = Field(
        False, description="with resume=false: start over even when checkpoint_dir holds the checkpoint of a run "
                           "that did not finish (deleting it); without it such a start is refused")
    keep_checkpoints: int = Field(3, ge=0, description="keep the newest K checkpoints (0: all)")
    max_restarts: int = Field(2, ge=0, description="relaunch the workers after a lost worker up to this many times, "
                                                   "resuming from the newest complete checkpoint")
    threads_per_worker: int = Field(1, gt=0, description="torch intra-op threads per worker process")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when available (the Spark-assigned GPU, else local rank), else cpu")
    progress: bool = Field(True, description="per-epoch progress bar on rank 0")
    tensorboard: bool = Field(False, description="also write TensorBoard scalars to <output>/tb")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking (jobs/train.py)")
    start_timeout: int = Field(120, gt=0, description="seconds the launcher waits for workers to start")
    bind_address: Optional[str] = Field(
        None, description="address (or host name) of this machine that the workers' sockets listen on; default: "
                          "the address of the route to MASTER_ADDR (loopback for the local launcher)")
    stall_timeout: float = Field(
        600, ge=0, description="a worker process (horovod, torch launchers) that completes no step, evaluation or "
                               "checkpoint for this many seconds prints its stacks and exits, so the launch fails and "
                               "is relaunched from the newest checkpoint instead of hanging on a dead peer; 0: off")
    stragglers: StragglerConfig = Field(default_factory=StragglerConfig,
                                        description="simulated slow workers (off by default)")
    simulated_clock: SimClockConfig = Field(default_factory=SimClockConfig,
                                            description="launcher inprocess: the simulated clock of runs that depend on "
                                                        "time (asynchronous algorithms, time-budgeted rounds, stragglers)")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig,
                                   description="launcher inprocess: the modelled cluster the simulated clock costs "
                                               "collectives and messages on (pipeline.train.comm.costmodel); set, it "
                                               "puts any inprocess run under the clock (default: simulated_clock's flat "
                                               "latency_s and bytes_per_s)")
    debug: DebugConfig = Field(default_factory=DebugConfig, description="test and fault-injection switches")

    @field_validator("output", "manifest")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not str(v).strip():
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.optimizer != "sgd" and self.nesterov:
            raise ConfigError("invalid config value nesterov=True: only with optimizer=sgd")
        if self.warmup_optimizer == "sgd" and (self.optimizer != "adam" or self.warmup_lr is None
                                               or not self.warmup_epochs):
            raise ConfigError("invalid config value warmup_optimizer='sgd': needs optimizer=adam, warmup_lr and "
                              "warmup_epochs > 0")
        if any(not 0 < f < 1 for f in self.lr_decay_at) or self.lr_decay_at != sorted(set(self.lr_decay_at)):
            raise ConfigError(f"invalid config value lr_decay_at={self.lr_decay_at}: increasing fractions in (0, 1)")
        from .algorithms.async_common import check_launcher  # asynchronous algorithms need torch.distributed p2p

        check_launcher(self.algorithm.name, self.algorithm.params, self.launcher)
        from .algorithms.eawild import check_moving_rate  # EA-wild: alpha = lr x rho in (0, 1)

        check_moving_rate(self)
        if self.launcher == "inprocess" and self.augment != "none":
            raise ConfigError(f"invalid config value augment={self.augment!r} with launcher='inprocess': the ranks "
                              "share the process's random generators; use launcher local for augmented runs")
        if self.fresh_start and self.resume is not False:
            raise ConfigError(f"invalid config value fresh_start=True with resume={self.resume!r}: fresh_start "
                              "deletes the checkpoints that resume would continue from; use one of them")
        if self.debug.fail_mode == "hang" and self.debug.fail_at_step and not self.stall_timeout:
            raise ConfigError("invalid config value debug.fail_mode='hang': needs stall_timeout > 0 (nothing would "
                              "end the blocked worker)")
        return self


def features_for(model: str) -> str:
    """Which input the model reads: image | hlf | llf | inclusive."""
    return {"lenet5": "image", "lenet5_bn": "image", "resnet20": "image", "hlf": "hlf", "gru": "llf", "inclusive": "inclusive"}[model]
