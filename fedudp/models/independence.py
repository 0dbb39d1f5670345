"""Per-record independence checked, not assumed: a model whose output for one record depends on
the other records of its batch is refused before any work.

Every batched kernel of the owners (``fedudp.owner.per_sample``'s one-pass per-record
gradients for DP-SGD, ``fedudp.owner.one_step``'s user vectors, ``fedudp.owner.ghost``'s
clipping; the Flower fast path, ``fedudp.flower.fast``, runs the one-step kernel) runs one
forward/backward over the records of many users and reads each record's gradient from it. That
is exact only when each record's output is a function of that record alone. A model that mixes
the records of a batch (``fc(x - x.mean(0))``, batch statistics such as a ``BatchNorm`` in
training mode, attention across the batch dimension, a buffer updated in place by the forward)
lets one user's records reach the other users' gradients: removing one user then moves an
owner's clipped sum by more than the clip (``fc(x - x.mean(0))`` against ``fc(x)``, measured
in docs/results/privacy_audit/paths_independence.md), and the ledger's ε no longer holds.

``check_independent(model, input_shape, classes, tokens, kernels)`` compares, on a public
example batch of ``RECORDS`` records (``fedudp.models.validate.example_batch``: the declared
shape, a fixed seed, distinct values; never data), in float64 where the model runs there (its
parameters and floating buffers cast to float64 in a ``functional_call``; otherwise in its own
dtype):

1. the batched forward's outputs with each record's forward alone (a batch of one), row by row
   (a forward that fails on a record alone but runs on the batch is refused too);
2. each ``kernels`` entry's per-record gradients (a mapping of labels to functions of the
   parameters and the batch giving ``{name: [R, ...]}``, from the caller: the models layer does
   not import the owners) with each record's own backward (cross-entropy of the record alone),
   parameter by parameter, and, where a kernel reports it under ``NORM``, its per-record norms
   with the norms of the records' own gradients;
3. every tensor handed to the forward (parameters and buffers, fresh copies) before and after:
   a version counter that moved is a buffer or parameter updated in place (state learned from
   the data outside the gradient step);
4. two batched forwards from two seeds: a forward that draws from torch's global generator is
   refused (its draws would differ between the batched kernels and a record's own pass).

Tolerance: ``|batched - alone| <= TOLERANCE[dtype] * max(1, max |alone|)`` per tensor
(``1e-9`` in float64, ``1e-4`` in float32 and below), NaNs equal where both have them. A
refusal is one line naming the innermost module whose inputs agree with the records' own but
whose outputs do not (forward hooks on every module, the calls matched in order; the model's
class when no submodule is to blame), and what to use instead. The model's parameters, buffers
and the global RNG are left as they were. The answer (accepted, or the refusal's message) is
remembered per model, record shape, dtype, classes, kernel labels and modules' modes, as
``fedudp.owner.per_sample.channels_last_ok`` does: a run's probe and every later call cost a
dictionary lookup.

What it cannot see: a model that mixes records only for other inputs or other parameter values
(a branch on the batch size, on the data's values) passes a black-box check on one batch; the
rule the docs state (docs/your-data.md) is the model's contract, the check its guard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from fedudp.models.validate import _Innermost, _where, example_batch

__all__ = [
    "RECORDS",
    "TOLERANCE",
    "NORM",
    "Kernel",
    "tolerance",
    "own_outputs",
    "own_gradients",
    "check_independent",
]

# records in the example batch (distinct fixed-seed values: a mean over them is no record's)
RECORDS = 6
# |batched - alone| <= TOLERANCE * max(1, max |alone|), per tensor (module doc)
TOLERANCE = {torch.float64: 1e-9}
_TOLERANCE_LOW = 1e-4  # float32, float16, bfloat16
# a kernel's per-record norms (float64 [R]), compared with the records' own gradients' norms
NORM = "__norm__"

Kernel = Callable[
    [Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor], Mapping[str, torch.Tensor]
]

_ADVICE = (
    "compute each record's output from that record alone (normalise per record: nn.LayerNorm "
    "or nn.GroupNorm, not batch statistics, BatchNorm in training mode or x - x.mean(0); "
    "attention within a record, never across the batch dimension)"
)

# model -> {key: None (accepted) or the refusal's message}
_MEMO: weakref.WeakKeyDictionary[nn.Module, dict[tuple, str | None]] = weakref.WeakKeyDictionary()


def tolerance(dtype: torch.dtype) -> float:
    """The comparison's tolerance for tensors of ``dtype`` (module doc).

    Parameters
    ----------
    dtype
        The tensors' dtype.

    Returns
    -------
    float
        ``TOLERANCE[dtype]``, or the lower-precision tolerance.
    """
    return TOLERANCE.get(dtype, _TOLERANCE_LOW)


def _gap(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |a - ref| / max(1, max |ref|)`` (0 where both are NaN; inf for another shape)."""
    if a.shape != ref.shape:
        return float("inf")
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a, ref) else float("inf")
    a64, r64 = a.detach().to(torch.float64), ref.detach().to(torch.float64)
    both = torch.isnan(a64) & torch.isnan(r64)
    diff = torch.where(both, 0.0, (a64 - r64).abs())
    diff = torch.where(torch.isnan(diff), float("inf"), diff)
    finite = r64[torch.isfinite(r64)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return float(diff.max()) / scale if diff.numel() else 0.0


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a module's arguments or output (tuples, lists, dicts), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


class _Trace:
    """Every module call of one forward, in the order they start: (module path, module, input
    tensors, output tensors, start, end) with copies of the tensors (an in-place layer after
    does not change them); nesting from the start and end ticks."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: list[list[Any]] = []
        self.stack: list[int] = []
        self.tick = 0
        self.hooks = []
        for name, mod in model.named_modules():
            self.hooks.append(mod.register_forward_pre_hook(self._enter(name)))
            self.hooks.append(mod.register_forward_hook(self._leave))

    def _enter(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(mod: nn.Module, args: tuple[Any, ...]) -> None:  # None: the input unchanged
            self.stack.append(len(self.calls))
            ins = [t.detach().clone() for t in _tensors(args)]
            self.calls.append([name, mod, ins, None, self.tick, None])
            self.tick += 1

        return hook

    def _leave(self, mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:  # output unchanged
        if self.stack:
            call = self.calls[self.stack.pop()]
            call[3] = [t.detach().clone() for t in _tensors(out)]
            call[5] = self.tick
            self.tick += 1

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _rows_agree(batched: list[torch.Tensor], alone: list[list[torch.Tensor]], tol: float) -> bool:
    """Whether each record's row of every batched tensor (leading dim R) equals that record's
    own (leading dim 1); tensors without the batch as leading dim are not compared."""
    R = len(alone)
    for i, b in enumerate(batched):
        if b.dim() == 0 or b.shape[0] != R:
            continue
        for r in range(R):
            if i >= len(alone[r]):
                return False
            a = alone[r][i]
            if a.dim() == 0 or a.shape[0] != 1 or a.shape[1:] != b.shape[1:]:
                continue
            if _gap(b[r : r + 1], a) > tol:
                return False
    return True


def _culprit(
    model: nn.Module, at: Mapping[str, torch.Tensor], x: torch.Tensor, tol: float
) -> str | None:
    """The innermost module whose inputs' rows agree with each record's own and whose outputs'
    rows do not (module doc); None when the calls of the batched and the records' forwards do
    not match up."""
    traces = []
    for xb in [x] + [x[r : r + 1] for r in range(len(x))]:
        tr = _Trace(model)
        try:
            with torch.no_grad():
                functional_call(model, dict(at), (xb,))
        finally:
            tr.close()
        traces.append(tr.calls)
    batched, alone = traces[0], traces[1:]
    if any(len(c) != len(batched) or [k[0] for k in c] != [k[0] for k in batched] for c in alone):
        return None
    blamed = []
    for i, (name, mod, ins, outs, start, end) in enumerate(batched):
        if outs is None:
            continue
        if _rows_agree(ins, [c[i][2] for c in alone], tol) and not _rows_agree(
            outs, [c[i][3] or [] for c in alone], tol
        ):
            blamed.append((start, end, name, mod))
    for start, end, name, mod in blamed:  # the first without a blamed module inside it
        if not any(s > start and e < end for s, e, _, _ in blamed):
            return _where(name, mod)
    return None


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """A forked global RNG seeded with ``seed`` (the caller's left as it was, CUDA's too)."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


def _copies(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Fresh copies of the model's parameters and buffers (floating ones cast to ``dtype``; None:
    their own), as one ``functional_call`` mapping."""
    out = {}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        c = t.detach().clone()
        out[n] = c.to(dtype) if dtype is not None and c.is_floating_point() else c
    return out


def _owner_of(model: nn.Module, name: str) -> str:
    path = name.rpartition(".")[0]
    return _where(path, model.get_submodule(path))


def _forward(model: nn.Module, at: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), _seeded(0):
        out = functional_call(model, dict(at), (x,))
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"model output is {type(out).__name__}, not a tensor of logits")
    return out


def own_outputs(
    model: nn.Module, at: Mapping[str, torch.Tensor], x: torch.Tensor
) -> list[torch.Tensor]:
    """Each record's output from its own forward (a batch of one): the reference of step 1.

    Parameters
    ----------
    model
        The model.
    at
        The parameters to evaluate at, by name.
    x
        The records' inputs.

    Returns
    -------
    list of torch.Tensor
        One output per record.
    """
    return [_forward(model, at, x[r : r + 1]) for r in range(len(x))]


def own_gradients(
    model: nn.Module, at: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Each record's gradient of its cross-entropy from its own forward and backward (a batch of
    one): the reference of step 2.

    Parameters
    ----------
    model
        The model.
    at
        The parameters to evaluate at, by name.
    x, y
        The records' inputs and labels.

    Returns
    -------
    dict of str to torch.Tensor
        ``{parameter name: [R, ...]}``.
    """
    names = [n for n, _ in model.named_parameters()]
    own: list[dict[str, torch.Tensor]] = []
    for r in range(len(x)):
        p = {k: v.detach().requires_grad_(k in names) for k, v in at.items()}
        with torch.enable_grad(), _seeded(0):
            loss = F.cross_entropy(functional_call(model, p, (x[r : r + 1],)), y[r : r + 1])
            gs = torch.autograd.grad(loss, [p[n] for n in names], allow_unused=True)
        own.append({n: (torch.zeros_like(p[n]) if g is None else g) for n, g in zip(names, gs)})
    return {n: torch.stack([o[n] for o in own]) for n in names}


def _state_step(model: nn.Module, at: Mapping[str, torch.Tensor], x: torch.Tensor) -> str | None:
    """Step 3: a parameter or buffer the forward updated in place."""
    versions = {k: v._version for k, v in at.items()}
    _forward(model, at, x)
    params = {n for n, _ in model.named_parameters()}
    for k, v in at.items():
        if v._version != versions[k]:
            kind = "parameter" if k in params else "buffer"
            return (
                f"model layer {_owner_of(model, k)} changes its {kind} {k!r} in place during "
                "forward: state updated from the batch outside the gradient step (it carries "
                "one batch's records into every record's output); keep layer state in "
                "parameters (nn.GroupNorm or nn.LayerNorm, not running statistics)"
            )
    return None


def _random_step(
    model: nn.Module, at: Mapping[str, torch.Tensor], x: torch.Tensor, tol: float
) -> str | None:
    """Step 4: a forward that draws from the global generator (two seeds, two outputs)."""
    with torch.no_grad(), _seeded(1):
        again = functional_call(model, dict(at), (x,))
    if _gap(again, _forward(model, at, x)) > tol:
        return (
            f"model {type(model).__name__} draws from torch's global random generator in its "
            "forward (two seeds, two outputs): the batched kernels and a record's own pass "
            "would draw differently, outside fedudp's keyed randomness; remove the random "
            "layer (nn.Dropout: p=0)"
        )
    return None


def _output_step(
    model: nn.Module, at: Mapping[str, torch.Tensor], x: torch.Tensor, tol: float, prec: str
) -> str | None:
    """Step 1: the batched forward's rows against each record's own forward."""
    R, out = len(x), _forward(model, at, x)
    try:
        alone = own_outputs(model, at, x)
    except Exception as e:  # noqa: BLE001 - the model's own code: a record alone fails
        with _Innermost(model) as inner, suppress(Exception):  # the same failure, located
            _forward(model, at, x[:1])
        where = inner.where()
        who = f"model layer {where}" if where else f"model {type(model).__name__}"
        line = (str(e).strip().splitlines() or [""])[0]
        return (
            f"{who} fails on a record alone (a batch of one) where a batch of {R} runs "
            f"({type(e).__name__}: {line}): its output depends on the other records of the "
            f"batch; {_ADVICE}"
        )
    gaps = [_gap(out[r : r + 1], alone[r]) for r in range(R)]
    worst = max(range(R), key=lambda r: gaps[r])
    if gaps[worst] <= tol:
        return None
    where = _culprit(model, at, x, tol)
    who = f"model layer {where}" if where else f"model {type(model).__name__}"
    return (
        f"{who} mixes the records of a batch: record {worst}'s output in a batch of {R} "
        f"differs from its output alone (relative difference {gaps[worst]:.3g}, {prec}), so "
        f"one user's records would reach other users' per-record gradients; {_ADVICE}"
    )


def _kernel_step(
    model: nn.Module,
    at: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    kernels: Mapping[str, Kernel],
    tol: float,
    prec: str,
) -> str | None:
    """Step 2: each kernel's per-record gradients (and norms) against each record's own."""
    if not kernels:
        return None
    cls, R = type(model).__name__, len(x)
    try:
        ref = own_gradients(model, at, x, y)
    except Exception as e:  # noqa: BLE001 - the model's own code: a record alone fails
        line = (str(e).strip().splitlines() or [""])[0]
        return (
            f"model {cls} fails in a record's own backward (a batch of one) where the batched "
            f"kernels run ({type(e).__name__}: {line}): its gradients depend on the other "
            f"records of the batch; {_ADVICE}"
        )
    for label, kernel in kernels.items():
        try:
            got = kernel({k: v.detach() for k, v in at.items()}, x, y)
        except NotImplementedError:  # a kernel the callers do not take for this model
            continue
        except Exception as e:  # noqa: BLE001 - the model's own code inside the kernel
            line = (str(e).strip().splitlines() or [""])[0]
            return f"model {cls} fails in {label} on the example batch: {type(e).__name__}: {line}"
        for n, g in got.items():
            if n == NORM:
                keys = [k for k in got if k != NORM]
                want = torch.cat([ref[k].reshape(R, -1) for k in keys], 1).double().norm(dim=1)
                gap, where = _gap(g.double(), want), f"norms over {keys}"
            else:
                gap, where = (
                    _gap(g, ref[n]),
                    f"gradients of {n} (model layer {_owner_of(model, n)})",
                )
            if gap > tol:
                return (
                    f"model {cls} mixes the records of a batch in its gradients: {label}'s "
                    f"per-record {where} differ from each record's own backward (relative "
                    f"difference {gap:.3g}, {prec}); {_ADVICE}"
                )
    return None


def _refusal(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    kernels: Mapping[str, Kernel],
) -> str | None:
    """The refusal's one-line message for ``model`` on the example batch (x, y), or None: the
    module doc's steps 3, 4, 1 and 2, in float64 where the model runs there."""
    dtype = next(model.parameters()).dtype
    at = _copies(model, torch.float64)
    xw = x.to(torch.float64) if x.is_floating_point() else x
    try:
        _forward(model, at, xw)
        work = torch.float64
    except Exception:  # noqa: BLE001 - the model's own code: it does not run in float64
        at, xw, work = _copies(model, None), x.to(dtype) if x.is_floating_point() else x, dtype
    tol = tolerance(work)
    prec = f"tolerance {tol:g} in {str(work).removeprefix('torch.')}"
    return (
        _state_step(model, at, xw)
        or _random_step(model, at, xw, tol)
        or _output_step(model, at, xw, tol, prec)
        or _kernel_step(model, at, xw, y, kernels, tol, prec)
    )


def check_independent(
    model: nn.Module,
    input_shape: Sequence[int],
    classes: int,
    tokens: bool = False,
    kernels: Mapping[str, Kernel] | None = None,
) -> None:
    """Refuse (one-line ``ValueError``) a model whose per-record outputs or per-record gradients
    depend on the other records of a batch (module doc), before any data is read.

    Parameters
    ----------
    model : torch.nn.Module
        The model, in the mode the kernels run it (its parameters and buffers are not changed).
    input_shape : sequence of int
        One record's declared shape (public).
    classes : int
        The declared number of classes: the example batch's labels are in ``[0, classes)``.
    tokens : bool, default False
        Records are token ids: the example batch holds fixed random ids below the smallest
        ``nn.Embedding``'s vocabulary (2 without one).
    kernels : mapping of str to callable, optional
        Batched per-record kernels to compare with each record's own backward: label ->
        ``kernel(params, x, y)`` giving ``{parameter name: [R, ...]}`` (and optionally ``NORM``:
        [R] norms over those names); ``params`` holds the model's parameters and buffers.

    Raises
    ------
    ValueError
        Naming the offending module (or the model's class) and what to use instead.
    """
    kernels = dict(kernels or {})
    params = list(model.parameters())
    if not params:
        return  # check_model refuses it, with its own message
    dtype = params[0].dtype
    vocab = None
    if tokens:
        sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
        vocab = min(sizes) if sizes else 2
    key = (
        tuple(int(s) for s in input_shape),
        int(classes),
        bool(tokens),
        vocab,
        str(dtype),
        tuple(sorted(kernels)),
        tuple(m.training for m in model.modules()),
    )
    memo = _MEMO.setdefault(model, {})
    if key not in memo:
        x, y = example_batch(input_shape, classes, tokens, dtype, records=RECORDS, vocab=vocab)
        x, y = x.to(params[0].device), y.to(params[0].device)
        memo[key] = _refusal(model, x, y, kernels)
    if memo[key] is not None:
        raise ValueError(memo[key])
