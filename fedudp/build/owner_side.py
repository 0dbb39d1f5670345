"""The model (built, checked and probed), the method's split and the owner component."""

from __future__ import annotations

from typing import Any, cast

import torch

from fedudp.build.plan import (
    input_spec,
    natural,
    planned_owner_records,
    planned_owner_users,
    planned_units,
)
from fedudp.build.run_settings import placement
from fedudp.config import (
    Accounting,
    ConfigError,
    EngineName,
    Method,
    OwnerWeights,
    Placement,
    RandomnessMode,
    RunConfig,
    SharedUpdate,
    Unit,
)
from fedudp.models import make_model
from fedudp.models.split import SplitModel
from fedudp.owner import local_sgd
from fedudp.owner.owners import OwnerHooks, Owners
from fedudp.owner.settings import OwnerTraining
from fedudp.plugins import load as load_plugins
from fedudp.protocol.methods import MethodSpec, make_method

__all__ = [
    "model",
    "builtin_model",
    "probe_model",
    "method",
    "owner_training",
    "device",
    "owners",
]


# -- models, method, owners -----------------------------------------------------------------------
def model(
    cfg: RunConfig, records: Any = None, given: Any = None, probe: bool = False
) -> SplitModel:
    """The configured model at the run seed's initialisation (float64 in equivalence mode),
    parameters frozen (the owner side trains functional copies): ``model.target`` (your own
    module), else ``model.name`` (``auto``: linear for flat features, cnn for images,
    char_gru for token sequences); ``given``: a module object from the Python API (copied).
    Layers that break per-user privacy (BatchNorm, ...) are refused, naming the layer.
    ``probe``: also run ``probe_model`` (``prepare`` does, once per run: a Flower owner
    rebuilding the model from the same config skips it).

    Parameters
    ----------
    cfg, records, given : RunConfig, Any, torch.nn.Module or None
        The configuration; in-memory records (their input shape); a module object.
    probe : bool, default False
        Also run ``probe_model``.

    Returns
    -------
    SplitModel
        The model, parameters frozen (float64 under ``engine_opts.float64``).

    Raises
    ------
    ConfigError
        A model that cannot be built, does not fit, or fails the checks or the probe.
    """
    from fedudp.models import custom, footprint
    from fedudp.models import validate as model_check

    load_plugins(cfg.plugins)  # a plugin's model (a Flower owner builds it from the config)
    shape, classes, tokens = input_spec(cfg, records)
    name = str(cfg.model.name)
    try:
        if given is not None:
            m = custom.fresh_copy(given)
        elif cfg.model.target:
            m = custom.from_target(
                cfg.model.target,
                dict(cfg.model.kwargs),
                input_shape=shape,
                classes=classes,
                seed=cfg.seed,
            )
        else:
            if name == "auto" and tokens:
                name = "char_gru"
            footprint.check_model(  # before any allocation (fedudp.models.footprint's rule)
                lambda c: make_model(name, shape, c, seed=cfg.seed),
                classes=classes,
                model_key=f"model.name={name}",
                float64=bool(cfg.engine_opts.float64),
                device=str(cfg.engine_opts.device),
                shared_and_units=lambda meta: _footprint_units(cfg, meta),
            )
            m = make_model(name, shape, classes, seed=cfg.seed)
        model_check.check_model(m)
        if probe:
            probe_model(m, shape, classes, tokens)  # output [batch, classes], per-record path
    except ConfigError:  # already names its key (fedudp.models.footprint)
        raise
    except ValueError as e:
        key = "model.target" if cfg.model.target and given is None else "model.name"
        raise ConfigError(f"{key}: {e}" if given is None else f"model: {e}") from None
    if cfg.engine_opts.float64:
        m = m.double()
    for prm in m.parameters():
        prm.requires_grad_(False)
    # a SplitModel, or a user's module that carries default_personal (fedudp.models.custom)
    return cast(SplitModel, m)


def _footprint_units(cfg: RunConfig, net: Any) -> tuple[tuple[str, ...], int]:
    """(the shared parameters' names, U) of ``fedudp.models.footprint``'s rule for ``net``
    (a model on the meta device): U, the units one vectorized owner step stacks at least, is
    1 unless the local engine computes user-level vectors (``placement=server``, user
    cohorts): then min(the expected cohort floor(q*N), the units one chunk holds)."""
    spec = method(cfg, net)
    if (
        spec.cohort_is_owners
        or EngineName(cfg.engine) != EngineName.local
        or placement(cfg) != Placement.server
        or (natural(cfg) and cfg.public.users is None)
    ):
        return spec.shared, 1
    per_user = cfg.public.records_per_user if natural(cfg) else cfg.partition.records_per_user
    cap = int(per_user or cfg.train.batch_size)  # at most a batch of a unit in one step
    if SharedUpdate(cfg.train.shared_update) == SharedUpdate.delta:
        cap = min(cap, int(cfg.train.batch_size))
    budget = local_sgd.chunk_budget(int(cfg.engine_opts.chunk_records), net)
    cohort = int(float(cfg.train.sampling_rate) * planned_units(cfg)[1])
    return spec.shared, max(1, min(cohort, budget // max(1, cap)))


def _inputs_declared(cfg: RunConfig) -> bool:
    """Whether ``input_spec`` answers from the config alone (no missing declaration)."""
    try:
        input_spec(cfg)
    except ConfigError:
        return False
    return True


def builtin_model(m: Any) -> bool:
    """Whether ``m``'s class is one of fedudp's own models (``fedudp.models``), whose
    per-record ``torch.func.vmap(grad(...))`` path ``tests/models/test_model_probe.py`` runs for
    every registered name: the run's probe skips that step for them (it imports
    ``torch._dynamo``, about a second of a small run's start); a user's or a plugin's model is
    always probed.

    Parameters
    ----------
    m : Any
        A model.

    Returns
    -------
    bool
        Whether its class is defined under ``fedudp.models``.
    """
    return type(m).__module__.startswith("fedudp.models.")


def probe_model(m: Any, shape: tuple[int, ...], classes: int, tokens: bool) -> None:
    """``fedudp.models.validate.probe`` on an example batch of the declared shape, and DP-SGD's
    one-pass per-record kernel on the same batch for every parameter whose layer qualifies for
    it (whichever of them a method shares, the kernel then runs on a subset of these layers; an
    exact nn.Linear applied twice per forward fails there); then every batched kernel's
    per-record outputs and gradients against each record's own pass (a model mixing the records
    of a batch is refused: ``fedudp.owner.independence``). One-line ``ValueError``.

    Parameters
    ----------
    m : Any
        The model (a ``torch.nn.Module``).
    shape : tuple of int
        Each record's declared feature shape.
    classes : int
        The number of classes (the output width).
    tokens : bool
        Whether the features are integer token ids.

    Raises
    ------
    ValueError
        A wrong output shape, a failing per-record kernel, or records mixed in a batch.
    """
    from fedudp.models import validate as model_check
    from fedudp.owner import independence, per_sample

    model_check.probe(m, shape, classes, tokens, per_record=not builtin_model(m))
    names = tuple(n for n, _ in m.named_parameters() if per_sample.supported(m, (n,)))
    if names:
        x, y = model_check.example_batch(shape, classes, tokens, next(m.parameters()).dtype)
        try:
            per_sample.per_record_gradients(m, dict(m.named_parameters()), x, y, names)
        except (NotImplementedError, RuntimeError) as e:
            raise ValueError(
                f"model fails in DP-SGD's one-pass per-record gradients "
                f"(fedudp.owner.per_sample): {' '.join(str(e).split())}; give a "
                "layer applied more than once per forward its own nn.Linear "
                "subclass (as char_rnn.RecurrentLinear does)"
            ) from None
    independence.check(m, shape, classes, tokens)  # per-record independence, every kernel


def method(cfg: RunConfig, net: SplitModel) -> MethodSpec:
    """The method's split, privacy and update (decided here, once).

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``method``, ``model.personal``, ``privacy.*``).
    net : SplitModel
        The model whose parameters are split into shared and personal.

    Returns
    -------
    MethodSpec
        The method's spec.

    Raises
    ------
    ConfigError
        The method refuses the split (named ``model.personal``).
    """
    try:
        return make_method(
            Method(cfg.method).value,
            net,
            personal=tuple(cfg.model.personal),
            unit=Unit(cfg.privacy.unit).value,
            placement=placement(cfg).value,
            paper=Accounting(cfg.privacy.accounting) == Accounting.paper,
        )
    except ValueError as e:
        raise ConfigError(f"model.personal: {e}") from None


def owner_training(cfg: RunConfig) -> OwnerTraining:
    """The owner side's public hyperparameters, and each owner's public capacity for
    owner-side DP-SGD (planned users; planned records under group privacy).

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``train.*``, ``privacy.*``, the plan).

    Returns
    -------
    OwnerTraining
        The shared and personal local SGD specs, the update, weights and capacities.
    """
    t = cfg.train
    records = planned_owner_records(cfg)
    capacity = records if cfg.privacy.group_privacy else planned_owner_users(cfg)
    return OwnerTraining(
        local_sgd.LocalSpec(cfg.seed, t.lr, t.batch_size, t.local_epochs),
        local_sgd.LocalSpec(cfg.seed, t.lr, t.batch_size, t.resolved_personal_epochs()),
        SharedUpdate(t.shared_update).value,
        OwnerWeights(t.owner_weights).value,
        dpsgd_records=bool(cfg.privacy.group_privacy),
        dpsgd_capacity=tuple(int(c) for c in capacity),
        public_owner_records=tuple(int(r) for r in records),
        sort_users=natural(cfg),
        secure_randomness=RandomnessMode(cfg.privacy.randomness) == RandomnessMode.secure,
    )


def device(cfg: RunConfig, *, actor: bool = False) -> torch.device:
    """Where the owners built in this process live: ``engine_opts.device`` (checked by
    ``fedudp.build.check_config``) with engine=local and in an engine=flower actor
    (``actor=True``); the CPU in engine=flower's driver, which runs no owner kernel. The
    billboard, the ledger, the generators and every noise draw stay on the CPU in every engine
    (docs/architecture.md#engines, docs/engines.md#gpus).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    actor : bool, default False
        The owners are built by a Flower actor (``fedudp.flower.client_app``), not the driver.

    Returns
    -------
    torch.device
        The device.
    """
    if EngineName(cfg.engine) == EngineName.flower and not actor:
        return torch.device("cpu")
    return torch.device(str(cfg.engine_opts.device))


def owners(
    cfg: RunConfig,
    hooks: OwnerHooks | None = None,
    net: SplitModel | None = None,
    spec: MethodSpec | None = None,
    records: Any = None,
    *,
    actor: bool = False,
) -> Owners:
    """The owner component from the config alone: the billboard process and every Flower
    owner build the same (on ``device(cfg, actor=actor)``). ``hooks``: a training algorithm's
    (``prepare`` passes them).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    hooks : OwnerHooks or None
        A training algorithm's owner hooks.
    net, spec : SplitModel or None, MethodSpec or None
        The model and method already built (None: built here with ``model`` / ``method``).
    records : Any, default None
        In-memory records (the model's input shape).
    actor : bool, default False
        Built by an engine=flower actor: its owners go on ``engine_opts.device``; the driver's
        (False) stay on the CPU (``device``).

    Returns
    -------
    Owners
        The owner component, its model moved to ``device(cfg, actor=actor)``.

    Raises
    ------
    ConfigError
        ``model``'s or ``method``'s errors, where they are built here.
    """
    if cfg.engine_opts.threads:
        torch.set_num_threads(cfg.engine_opts.threads)
    net = net if net is not None else model(cfg, records)
    _place(net, device(cfg, actor=actor))  # in place: the owners' model on their device
    spec = spec if spec is not None else method(cfg, net)
    return Owners(
        net,
        spec,
        owner_training(cfg),
        local_sgd.chunk_budget(cfg.engine_opts.chunk_records, net),
        hooks=hooks,
    )


def _place(net: SplitModel, where: torch.device) -> None:
    """Move the owners' model to ``where``, in place (a test's spy sees the device here)."""
    net.to(where)
