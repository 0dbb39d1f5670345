"""The fast path of ``fedudp.flower.user_level_mod``: all sampled users' updates at once, with
fedudp's owner kernels, when the app's training step is plain PyTorch SGD (docs/flower-apps.md).

``user_level_mod`` normally calls the app's own ``@app.train()`` once per sampled user: any
training code works, but every call rebuilds the model, loads the broadcast and builds a reply,
and a client with many users pays that per user. An app whose training step is plain PyTorch
(a model, cross-entropy, SGD at a learning rate, each user's records) can declare it instead::

    from fedudp.flower import user_level_mod
    from fedudp.flower.fast import TorchTraining

    app = ClientApp(
        mods=[user_level_mod(users_per_client=10, fast=TorchTraining(make_model, load_data, lr="lr"))]
    )

and the mod computes the sampled users' updates together, the way fedudp's own engine computes
its owners' users (``fedudp.owner.one_step``: one batched forward/backward for users whose update
is one SGD step on all their records; ``fedudp.owner.local_sgd``: users' multi-step SGD
trajectories vectorized). Nothing else changes: the users are the mod's Poisson sample, each
update is the change of the shared parameters after the user's SGD from the broadcast (personal
layers at the broadcast's public values), and the mod clips and sums them exactly as on the
per-user path; personal layers never leave the client. The client's own personal layers are
trained as on the per-user path (every user in order, each from the previous one's personal
layers), by the same declared SGD.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedudp.flower.fast_checks import check_declaration, positive_int, refused_layers
from fedudp.flower.fast_data import RUN_CONFIG, Unreproducible, records_of, setting
from fedudp.flower.guard import one_line
from fedudp.owner import local_sgd, per_sample
from fedudp.owner.one_step import one_step_vectors

__all__ = ["RUN_CONFIG", "TorchTraining"]

Records = tuple[Any, Any] | Iterable[tuple[Any, Any]]

# records per batched forward/backward (memory bound; the users of a chunk share one pass)
CHUNK_RECORDS = 8192


@dataclass(frozen=True)
class _Run:
    """One round's resolved settings (public: the server's config and the run config)."""

    lr: float
    epochs: int
    batch: int | None
    round: int


@dataclass
class TorchTraining:
    """The app's training step, declared as plain PyTorch SGD, for ``user_level_mod``'s fast
    path.

    Parameters
    ----------
    model : Callable[[], torch.nn.Module] or torch.nn.Module
        The model (or a function building it, called once): its architecture. Its parameter
        values come from each training message's arrays, by ``state_dict`` name. Batch
        normalization and dropout are refused (a user's update would depend on other records
        of a batch, or on the app's random stream), and so, before the first update, is any
        model whose per-record outputs or gradients depend on the other records of a batch
        (``check_independent``: ``x - x.mean(0)``, attention across the batch, a buffer the
        forward updates).
    data : Callable
        The app's own loader, as it is called on the per-user path (``partition_id`` is the
        user's global index, ``num_partitions`` the number of users N):
        ``data(partition_id, num_partitions)``, or Flower's quickstart's
        ``data(partition_id, num_partitions, batch_size)`` (called with ``batch_size``; one
        that requires it without a declared ``batch_size`` is refused here). Returns ``(x, y)``
        (tensors or arrays: inputs and integer class labels), an iterable of batches (a
        ``DataLoader``; batches ``(x, y)`` or dicts read at ``keys``), concatenated in order,
        or a tuple of loaders whose first is the training loader (the quickstart's
        ``(trainloader, testloader)``). A returned ``DataLoader`` must batch and order the
        records as declared (``batch_size``, ``shuffle``; no ``drop_last``, no custom sampler):
        anything else fails the client with a one-line error naming the difference.
    lr : float or str
        The SGD learning rate, or a key: of a ``ConfigRecord`` entry in the training message
        (the server's ``train_config``, e.g. ``"lr"``), else of the client's run config.
    epochs : int or str, default 1
        Passes over a user's records, or a key as for ``lr`` (the quickstart's
        ``"local-epochs"``).
    batch_size : int, str or None, default None
        Records per SGD step (the last batch of an epoch may be smaller), or a key as for
        ``lr`` (the quickstart's ``"batch-size"``); passed to ``data`` when it takes a third
        argument. None: all of a user's records in one step.
    loss : str, callable or torch.nn.CrossEntropyLoss, default "cross_entropy"
        The loss, mean over a batch: cross-entropy only (``"cross_entropy"``,
        ``torch.nn.functional.cross_entropy`` or a ``CrossEntropyLoss()`` with its defaults).
    loss_metric : str or None, default "train_loss"
        The name under which each sampled user's training metric is reported (None: none): its
        mean loss over its records at the broadcast, i.e. the loss of its first SGD step (what
        an app's one-step ``train`` returns), with ``num-examples`` its number of records; the
        mod averages the users' metrics weighted by their records, as on the per-user path.
    momentum, dampening, weight_decay : float, default 0.0
        The app's ``torch.optim.SGD`` settings (Flower's quickstart: ``momentum=0.9``), used
        as the app's optimizer uses them, one fresh optimizer per user and round.
    nesterov : bool, default False
        The app's ``torch.optim.SGD(nesterov=...)``.
    shuffle : bool, default False
        Whether the app's loader shuffles (``DataLoader(shuffle=True)``, the quickstart's): each
        user's records are then visited in a fresh random order every epoch; False: in the
        order ``data`` returns them.
    shuffle_seed : int or None, default None
        None: the shuffling orders come from OS entropy; an int: from
        ``numpy.random.default_rng([shuffle_seed, round, user])`` (reproducible).
    keys : tuple of two str or None, default None
        The (inputs, labels) keys of dict batches; None: ``("img", "label")``.

    Notes
    -----
    A user's update is what the per-user path sends for an app whose ``@app.train()`` builds the
    model, loads the broadcast, and runs ``torch.optim.SGD(model.parameters(), lr, momentum,
    dampening, weight_decay, nesterov)`` for ``epochs`` passes of ``batch_size`` records on the
    user's records (in order, or shuffled each epoch): the change of the shared parameters,
    equal to the per-user path's up to float rounding for the same order
    (tests/engines/test_flower_fast.py, test_flower_first_run.py). Plain SGD (no momentum, no
    weight decay) runs on fedudp's vectorized kernels; momentum, dampening, weight decay or
    Nesterov run the app's optimizer user by user (slower, the same steps). The fast path
    cannot see the app's optimizer: declare its settings here. Users without records contribute a zero
    update. A user whose ``data`` raises, or whose records break the batched pass (it is then
    retried user by user), is dropped alone with its reason; a user whose update is NaN/inf (a
    non-finite record) is dropped by the mod as on the per-user path (``fedudp.flower.guard``). Which users take part, the clipping, the sum and the counts are the mod's, as on the
    per-user path. The app's own training metrics are not computed on this path: only
    ``loss_metric`` and ``num-examples``.
    """

    model: Callable[[], nn.Module] | nn.Module
    data: Callable[..., Records]
    lr: float | str
    epochs: int | str = 1
    batch_size: int | str | None = None
    loss: Any = "cross_entropy"
    loss_metric: str | None = "train_loss"
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    shuffle: bool = False
    shuffle_seed: int | None = None
    keys: tuple[str, str] | None = None
    _module: nn.Module | None = field(default=None, init=False, repr=False)
    _one_step_ok: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        self._passes_batch = check_declaration(self)

    @property
    def plain(self) -> bool:
        """Whether the declared optimizer is plain SGD (no momentum, dampening, weight decay or
        Nesterov): the users' trajectories then run on the vectorized kernels."""
        return (
            not (float(self.momentum) or float(self.dampening) or float(self.weight_decay))
            and not self.nesterov
        )

    def resolved(self, configs: Mapping[str, Any]) -> _Run:
        """The round's settings: ``lr``, ``epochs`` and ``batch_size`` read where given as keys
        (the message's config records, then the run config), and the round number.

        Parameters
        ----------
        configs : Mapping[str, Any]
            The training message's config records and, under ``RUN_CONFIG``, the run config.

        Returns
        -------
        _Run
        """
        epochs = positive_int("epochs", setting("epochs", self.epochs, configs))
        b = setting("batch_size", self.batch_size, configs)
        batch = None if b is None else positive_int("batch_size", b)
        dp = configs.get("fedudp.dp") or {}
        return _Run(self.learning_rate(configs), epochs, batch, int(dp.get("round", 0)))

    # -- pieces --------------------------------------------------------------------------------
    def module(self) -> nn.Module:
        """The model (built once), checked for layers the fast path refuses."""
        if self._module is None:
            m = self.model if isinstance(self.model, nn.Module) else self.model()
            if not isinstance(m, nn.Module):
                raise TypeError("TorchTraining: model must be an nn.Module or build one")
            bad = refused_layers(m)
            if bad:
                raise ValueError(
                    f"TorchTraining: the fast path refuses {', '.join(bad)}; leave fast= out "
                    "of user_level_mod to run the app's own training step per user"
                )
            self._module = m.train()
        return self._module

    def check_independent(self, x: torch.Tensor) -> None:
        """Refuse (one-line ``ValueError``, before any user's update) a model whose per-record
        outputs or gradients depend on other records of a batch: the one-step kernel reads every
        user's update from one pass over many users' records (``fedudp.owner.independence``, on
        a public example batch of the records' shape ``x.shape[1:]``, never their values;
        remembered per model).

        Parameters
        ----------
        x : torch.Tensor
            A batch of one user's records.

        Raises
        ------
        ValueError
        """
        from fedudp.owner import independence

        shape, tokens = tuple(x.shape[1:]), not x.is_floating_point()
        try:
            independence.check(self.module(), shape, None, tokens)
        except ValueError as e:
            raise ValueError(f"TorchTraining: {e}") from None

    def learning_rate(self, configs: Mapping[str, Any]) -> float:
        """``lr``, or the value of the key ``lr`` in one of the message's config records (the
        app's: fedudp's own ``fedudp.*`` records are not looked at), else in the run config.

        Parameters
        ----------
        configs : Mapping[str, Any]
            The training message's config records and, under ``RUN_CONFIG``, the run config.

        Returns
        -------
        float
        """
        lr = float(setting("lr", self.lr, configs))
        if not lr > 0:
            raise ValueError(f"TorchTraining: lr={self.lr!r} is {lr}; it must be > 0")
        return lr

    def load(
        self, users: Sequence[int], num_users: int, batch_size: int | None = None
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor] | None], dict[int, str]]:
        """Each user's records ``(x, y)`` (None for a user whose ``data`` raised or gave
        something that is not records), and {index into ``users``: the one-line reason} for
        those: a user's bad data is that user's alone (``fedudp.flower.guard``). ``batch_size``:
        the resolved declared one (``resolved``), passed to a three-argument ``data``. A loader
        the declaration would not reproduce (``Unreproducible``) fails the client instead.

        Parameters
        ----------
        users : Sequence[int]
            The users' global indices.
        num_users : int
            N.
        batch_size : int or None

        Returns
        -------
        tuple[list, dict[int, str]]
        """
        if batch_size is None and isinstance(self.batch_size, int):
            batch_size = self.batch_size
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        raised: dict[int, str] = {}
        for i, u in enumerate(users):
            try:
                out.append(self._one(int(u), int(num_users), batch_size))
            except Unreproducible:
                raise
            except Exception as e:  # noqa: BLE001  (the user is dropped alone, with its reason)
                out.append(None)
                raised[i] = f"data({u}, {num_users}): {one_line(e)}"
        return out, raised

    def _one(
        self, u: int, num_users: int, batch_size: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._passes_batch:
            if batch_size is None:
                raise Unreproducible(
                    f"TorchTraining: batch_size={self.batch_size!r} is not resolved (call "
                    "load with the round's batch size)"
                )
            got, where = (
                self.data(u, num_users, batch_size),
                f"data({u}, {num_users}, {batch_size})",
            )
        else:
            got, where = self.data(u, num_users), f"data({u}, {num_users})"
        return records_of(got, where, batch_size, bool(self.shuffle), self.keys)

    @staticmethod
    def _concat(
        loaded: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, np.ndarray, np.ndarray]:
        """(x, y, starts, sizes) of the loaded users in order (a None user: no records)."""
        xs = [r[0] for r in loaded if r is not None]
        ys = [r[1] for r in loaded if r is not None]
        sizes_a = np.asarray([0 if r is None else len(r[1]) for r in loaded], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes_a)[:-1]]).astype(np.int64)
        if not xs:
            return None, None, starts[: len(loaded)], sizes_a
        return torch.cat(xs), torch.cat(ys), starts, sizes_a

    def records(
        self, users: Sequence[int], num_users: int, batch_size: int | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, np.ndarray, np.ndarray]:
        """(x, y, starts, sizes): the users' records, concatenated in the users' order (a
        ``ValueError`` naming the first user whose ``data`` failed).

        Parameters
        ----------
        users : Sequence[int]
        num_users : int
        batch_size : int or None

        Returns
        -------
        tuple[torch.Tensor or None, torch.Tensor or None, numpy.ndarray, numpy.ndarray]
        """
        loaded, raised = self.load(users, num_users, batch_size)
        if raised:
            raise ValueError(f"TorchTraining: {next(iter(raised.values()))}")
        return self._concat(loaded)

    def _params(self, arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        model = self.module()
        want = list(model.state_dict().keys())
        missing = [k for k in want if k not in arrays]
        if missing:
            raise ValueError(
                f"TorchTraining: the training message's arrays lack the model's {missing[:5]} "
                "(the fast path's model must be the app's)"
            )
        return {k: torch.tensor(np.asarray(arrays[k])) for k in want}

    def _orders(
        self, sizes: np.ndarray, starts: np.ndarray, run: _Run, users: Sequence[int]
    ) -> np.ndarray:
        """[U, E, L]: each epoch's visiting order of each user's records (padded with -1 at
        the end): in their order, or with ``shuffle`` a fresh permutation per user and epoch."""
        L = int(sizes.max()) if len(sizes) else 0
        col = np.arange(L)[None, :]
        one = np.where(col < sizes[:, None], starts[:, None] + col, -1)
        out = np.repeat(one[:, None, :], run.epochs, axis=1)
        if self.shuffle:
            for i, (u, k) in enumerate(zip(users, sizes, strict=True)):
                key = None if self.shuffle_seed is None else [self.shuffle_seed, run.round, u]
                rng = np.random.default_rng(key)
                for e in range(run.epochs):
                    out[i, e, :k] = starts[i] + rng.permutation(int(k))
        return out

    def _steps_one(self, sizes: np.ndarray, run: _Run) -> bool:
        """Whether every user's training is one SGD step on all its records (momentum and
        dampening do not change a first step; weight decay and Nesterov do)."""
        one_batch = run.batch is None or not len(sizes) or int(sizes.max()) <= run.batch
        first_is_sgd = not float(self.weight_decay) and not self.nesterov
        return run.epochs == 1 and one_batch and first_is_sgd

    def _sgd(
        self,
        params: dict[str, torch.Tensor],
        trainable: Sequence[str],
        x: torch.Tensor,
        y: torch.Tensor,
        starts: np.ndarray,
        sizes: np.ndarray,
        run: _Run,
        users: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        """{name: [U, ...]}: each user's ``trainable`` parameters after its SGD from ``params``
        (plain SGD: ``fedudp.owner.local_sgd``, the users' trajectories vectorized; otherwise
        the declared ``torch.optim.SGD``, user by user)."""
        model = self.module()
        U = len(sizes)
        batch = run.batch if run.batch is not None else max(int(sizes.max()), 1)
        orders = self._orders(sizes, starts, run, users)
        if not self.plain:
            return self._sgd_optim(params, trainable, x, y, orders, run.lr, batch)
        spec = local_sgd.LocalSpec(seed=0, lr=run.lr, batch_size=batch, epochs=run.epochs)
        frozen = {k: v for k, v in params.items() if k not in trainable}
        start = local_sgd.expand({k: params[k] for k in trainable}, U)
        return local_sgd.local_sgd(model, start, {}, frozen, x, y, orders, spec)

    def _sgd_optim(
        self,
        params: dict[str, torch.Tensor],
        trainable: Sequence[str],
        x: torch.Tensor,
        y: torch.Tensor,
        orders: np.ndarray,
        lr: float,
        batch: int,
    ) -> dict[str, torch.Tensor]:
        """The app's ``torch.optim.SGD`` (momentum, dampening, weight decay, Nesterov as
        declared) over each user's records in ``orders``, a fresh optimizer per user."""
        model = self.module()
        out: dict[str, list[torch.Tensor]] = {k: [] for k in trainable}
        for u in range(orders.shape[0]):
            w = {k: v.detach().clone() for k, v in params.items()}
            leaves = [w[k].requires_grad_(True) for k in trainable]
            opt = torch.optim.SGD(
                leaves,
                lr=lr,
                momentum=float(self.momentum),
                dampening=float(self.dampening),
                weight_decay=float(self.weight_decay),
                nesterov=bool(self.nesterov),
            )
            for e in range(orders.shape[1]):
                idx = orders[u, e]
                idx = idx[idx >= 0]
                for b0 in range(0, len(idx), batch):
                    b = torch.from_numpy(idx[b0 : b0 + batch])
                    opt.zero_grad()
                    out_b = torch.func.functional_call(model, w, (x[b],))
                    F.cross_entropy(out_b, y[b]).backward()
                    opt.step()
            for k in trainable:
                out[k].append(w[k].detach())
        return {k: torch.stack(v) for k, v in out.items()}

    # -- what the mod calls --------------------------------------------------------------------
    def updates(
        self,
        arrays: Mapping[str, np.ndarray],
        names: Sequence[str],
        users: Sequence[int],
        num_users: int,
        configs: Mapping[str, Any],
    ) -> tuple[torch.Tensor, list[tuple[float, dict[str, float]]], dict[int, str]]:
        """([len(users), d] float64, metrics, raised): each user's update of the parameters
        ``names`` (flattened in that order), from ``arrays`` (the broadcast, every parameter by
        ``state_dict`` name) by the declared SGD on that user's records alone; per user (its
        records, {``loss_metric``: its mean loss at the broadcast}); and {index into ``users``:
        reason} for the users whose data or training raised (their rows are zeros, to be
        dropped: ``fedudp.flower.guard.user_rows``). ``configs``: the training message's config
        records (for ``lr`` given as a key). A user's NaN/inf record leaves a non-finite row of
        its own (the kernels compute each user's update from its records only).

        Parameters
        ----------
        arrays : Mapping[str, numpy.ndarray]
            The broadcast, every parameter by ``state_dict`` name.
        names : Sequence[str]
            The shared parameters, in order.
        users : Sequence[int]
            The sampled users' global indices.
        num_users : int
            N.
        configs : Mapping[str, Any]
            The training message's config records and, under ``RUN_CONFIG``, the run config.

        Returns
        -------
        tuple[torch.Tensor, list, dict[int, str]]
        """
        names = tuple(names)
        params = self._params(arrays)
        d = sum(int(params[k].numel()) for k in names)
        if not len(users):
            return torch.zeros(0, d, dtype=torch.float64), [], {}
        run = self.resolved(configs)
        self.module()  # a refused model fails the client (a setup error), before any user
        loaded, raised = self.load(users, num_users, run.batch)
        for one in [r for r in loaded if r is not None][:1]:
            self.check_independent(one[0])  # before any update; a refusal fails the client
        try:
            G, metrics = self._updates(params, names, loaded, run, d, users)
        except Exception:  # noqa: BLE001  (some user's records break the batched pass)
            G = torch.zeros(len(users), d, dtype=torch.float64)
            metrics = [(0.0, {}) for _ in users]
            for i, rec in enumerate(loaded):  # each user alone: the one that raises is dropped
                if rec is None:
                    continue
                try:
                    g, m = self._updates(params, names, [rec], run, d, [users[i]])
                except Exception as e:  # noqa: BLE001  (dropped alone, with its reason)
                    raised[i] = f"training user {users[i]}: {one_line(e)}"
                    continue
                G[i], metrics[i] = g[0], m[0]
        return G, metrics, raised

    def _updates(
        self,
        params: dict[str, torch.Tensor],
        names: tuple[str, ...],
        loaded: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
        run: _Run,
        d: int,
        users: Sequence[int],
    ) -> tuple[torch.Tensor, list[tuple[float, dict[str, float]]]]:
        """``updates`` for the loaded users (a None user: no records, a zero update)."""
        lr = run.lr
        user_ids = np.asarray([int(u) for u in users], dtype=np.int64)
        out = torch.zeros(len(loaded), d, dtype=torch.float64)
        x, y, starts, sizes = self._concat(loaded)
        has = np.flatnonzero(sizes > 0)  # users without records: a zero update
        if not len(has) or not d:
            return out, [(float(k), {}) for k in sizes]
        assert x is not None and y is not None  # some user has records
        model = self.module()
        metrics = self._metrics(params, x, y, sizes)
        trainable = tuple(k for k, _ in model.named_parameters())
        w0 = torch.cat([params[k].reshape(-1) for k in names])
        one = self._steps_one(sizes, run) and self._one_step_ok
        if one and not per_sample.supported(model, names):
            one = False
        cap = None if one else run.batch
        for sel in local_sgd.chunks(sizes[has], CHUNK_RECORDS, cap):
            rows = has[sel]
            if one:
                try:  # -lr times each user's mean gradient at the broadcast: one pass
                    V = one_step_vectors(model, params, x, y, starts[rows], sizes[rows], names, -lr)
                except NotImplementedError:  # e.g. a Linear on inputs with middle dims
                    self._one_step_ok = one = False
                else:
                    # the float32 model after the step, as the app's SGD leaves it
                    stepped = w0.unsqueeze(0) + V.to(w0.dtype)
                    out[torch.from_numpy(rows)] = stepped.double() - w0.double()
                    continue
            end = self._sgd(params, trainable, x, y, starts[rows], sizes[rows], run, user_ids[rows])
            flat = torch.cat([end[k].reshape(len(rows), -1) for k in names], dim=1)
            out[torch.from_numpy(rows)] = flat.double() - w0.double()
        return out, metrics

    def _metrics(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, sizes: np.ndarray
    ) -> list[tuple[float, dict[str, float]]]:
        """Per user: (its records, {loss_metric: its mean loss at ``params``})."""
        if self.loss_metric is None:
            return [(float(k), {}) for k in sizes]
        with torch.no_grad():
            per = F.cross_entropy(
                torch.func.functional_call(self.module(), params, (x,)), y, reduction="none"
            ).double()
        of = torch.from_numpy(np.repeat(np.arange(len(sizes)), sizes))
        sums = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, of, per)
        return [
            (float(k), {self.loss_metric: float(s / k)} if k else {})
            for k, s in zip(sizes, sums.tolist(), strict=True)
        ]

    def personal(
        self,
        arrays: Mapping[str, np.ndarray],
        names: Sequence[str],
        users: Sequence[int],
        num_users: int,
        configs: Mapping[str, Any],
    ) -> dict[str, np.ndarray]:
        """The client's personal parameters ``names`` after every user's SGD in order, each
        from ``arrays`` (the broadcast's shared parameters and the client's current personal
        ones) with the personal parameters the previous user left, as the per-user path
        chains the app's step.

        Parameters
        ----------
        arrays : Mapping[str, numpy.ndarray]
        names : Sequence[str]
            The personal parameters.
        users : Sequence[int]
            All the client's users.
        num_users : int
        configs : Mapping[str, Any]
            The training message's config records and, under ``RUN_CONFIG``, the run config.

        Returns
        -------
        dict[str, numpy.ndarray]
        """
        params = self._params(arrays)
        run = self.resolved(configs)
        loaded, _ = self.load(users, num_users, run.batch)  # a user whose data raised: skipped
        model = self.module()
        trainable = tuple(k for k, _ in model.named_parameters())
        own = {k: params[k] for k in names}
        for u, one in zip(users, loaded, strict=True):
            if one is None or not len(one[1]):
                continue
            x, y = one
            at = {**params, **own}
            z, k = np.zeros(1, np.int64), np.array([len(y)])
            try:
                end = self._sgd(at, trainable, x, y, z, k, run, [int(u)])
            except Exception:  # noqa: BLE001  (a user whose step raises is skipped alone)
                continue
            got = {k: end[k][0].detach() for k in names}
            if all(bool(torch.isfinite(v).all()) for v in got.values()):  # else skipped
                own = got
        return {k: v.detach().numpy() for k, v in own.items()}
