"""One-step user vectors (``fedudp.owner.one_step``) against the ones ``local_sgd`` computes:
each user's delta after its one SGD step, or its mean gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedudp.owner import local_sgd
from fedudp.owner.orders import batch_orders
from fedudp.randomness import Purpose
from fedudp.owner.kernels import Kernels
from fedudp.owner.one_step import one_step_vectors
from fedudp.models.cnn import PaperCNN
from fedudp.privacy.mechanisms import clip_factors
from tests.owner.kernel_switch import owners_take


def _setup(model, sizes, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = int(sum(sizes))
    x = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=g)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return x, y, params, starts, np.asarray(sizes, dtype=np.int64)


def _reference(model, params, x, y, starts, sizes, names, lr, clip):
    """Each user's delta by local SGD (one epoch, batch >= its size: one step), clipped, summed."""
    U = len(sizes)
    units = local_sgd.Units(starts, sizes, np.zeros(U, np.int64), np.zeros(U, np.int64), sizes)
    spec = local_sgd.LocalSpec(seed=0, lr=lr, batch_size=int(sizes.max()), epochs=1)
    orders = batch_orders(units, spec, 1, Purpose.USER_ORDER, np.arange(U))
    trainable = {k: params[k] for k in names}
    common = {k: v for k, v in params.items() if k not in names}
    end = local_sgd.local_sgd(model, local_sgd.expand(trainable, U), {}, common, x, y, orders, spec)
    G = local_sgd.flat_delta(end, trainable, names)
    factor, was = clip_factors(G, clip)
    return (G * factor.unsqueeze(1)).sum(0), int(was.sum()), G


@pytest.mark.parametrize("sizes", [[1] * 12, [1, 3, 10, 2, 7, 1, 5]])
@pytest.mark.parametrize("personal", [False, True])
def test_cnn_vectors_equal_the_per_user_deltas(sizes, personal):
    torch.manual_seed(0)
    model = PaperCNN().double()
    names = tuple(n for n, _ in model.named_parameters() if not (personal and n.startswith("fc1")))
    x, y, params, starts, sizes = _setup(model, sizes, (1, 28, 28))
    _, _, ref = _reference(model, params, x, y, starts, sizes, names, 0.05, 1.0)
    got = one_step_vectors(model, params, x, y, starts, sizes, names, -0.05)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-13)


def test_linear_model_mean_gradients():
    model = torch.nn.Linear(6, 10).double()
    x, y, params, starts, sizes = _setup(model, [4, 1, 2, 6], (6,), seed=3)
    names = ("weight", "bias")
    _, _, G = _reference(model, params, x, y, starts, sizes, names, 1.0, 1e9)  # -mean gradient
    torch.testing.assert_close(
        one_step_vectors(model, params, x, y, starts, sizes, names, 1.0), -G, rtol=1e-9, atol=1e-13
    )


def test_vectors_and_the_thread_count():
    """Bit for bit at one thread count (a resumed run with the same ``engine_opts.threads`` is
    the same run), and across thread counts equal up to float32 summation order, as the per-user
    loop's backward: one-record users to a few float32 ulps (on some CPUs bit for bit, but the
    forward's own kernels may change their reduction order with the thread count: on this
    project's 2-core Xeon VM 1 and 2 threads differ by up to 3.7e-9 in every layer), multi-record
    users also in their convolutions' weight gradients."""
    torch.manual_seed(1)
    model = PaperCNN()
    before = torch.get_num_threads()
    for sizes in ([1] * 100, [1, 2, 1, 5, 3, 10, 32] * 14):
        x, y, params, starts, sizes = _setup(model, sizes, (1, 28, 28))
        x = x.float()
        names = tuple(params)
        try:
            got = []
            for t in (1, 2, 1):
                torch.set_num_threads(t)
                got.append(one_step_vectors(model, params, x, y, starts, sizes, names, -0.05))
        finally:
            torch.set_num_threads(before)
        assert torch.equal(got[0], got[2])
        if sizes.max() == 1:
            torch.testing.assert_close(got[0], got[1], rtol=1e-6, atol=1e-8)
        else:
            torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "rpu,method,batch",
    [(1, "full_dp", 8), (3, "joint_dp", 8), (10, "full_dp", 8), (10, "full_dp", 16)],
)
def test_a_run_takes_the_one_step_path_and_equals_the_per_user_vectors(
    rpu, method, batch, tmp_path, monkeypatch
):
    """The paper CNN on MNIST-format data, users of 1 and 3 records (one SGD step each): the run
    with one-step vectors equals the run through ``local_sgd`` up to float32 rounding,
    and the one-step path is the one taken. With 10 records per user (75-record owners: users of
    10 and one of 5) at batch 8, the users of 10 (two steps) train through ``local_sgd`` and the
    others take the one-step path, merged into one reply; at batch 16 every user takes it (a
    multi-record user's convolution weight gradient from one kernel over its records)."""
    import fedudp.owner.batched as batched
    from conftest import tiny_cfg, tiny_mnist
    from fedudp.run import run

    root = tiny_mnist(tmp_path / "data")
    calls = []
    orig = batched.one_step_vectors
    monkeypatch.setattr(
        batched, "one_step_vectors", lambda *a, **k: calls.append(1) or orig(*a, **k)
    )
    out = {}
    for flag in (True, False):
        # the vectors built and clipped (the ghost path, which one-record CNN users take by
        # default, is compared with this one in tests/owner/test_ghost.py)
        owners_take(monkeypatch, Kernels(ghost=False, one_step=flag))
        cfg = tiny_cfg(
            method,
            dataset__name="mnist",
            dataset__root=str(root),
            model__name="cnn",
            dataset__num_records=300,
            partition__records_per_user=rpu,
            train__rounds=2,
            train__batch_size=batch,
        )
        out[flag] = run(cfg, tmp_path / str(flag))
    assert len(calls) >= 2  # the fast path, every round
    assert out[True]["epsilon"] == out[False]["epsilon"]
    assert out[True]["accuracy_mean"] == out[False]["accuracy_mean"]
    assert out[True]["loss"] == pytest.approx(out[False]["loss"], rel=1e-5)


@pytest.mark.parametrize("batch", [40, 37])
def test_fedavg_owners_of_one_step_take_the_path_and_equal_local_sgd(batch, tmp_path, monkeypatch):
    """Standard FedAvg (``owner_sgd``) on the paper CNN, 300 records over 8 owners of 37 and 38
    records: at batch 40 every owner's delta is one SGD step on all its records and comes from
    the one-step path; at batch 37 the owners of 37 take it and those of 38 (two steps) train
    through ``local_sgd``, their rows interleaved in one matrix. The run equals the run with
    every owner through ``local_sgd`` up to float32 rounding."""
    import fedudp.owner.batched as batched
    from conftest import tiny_cfg, tiny_mnist
    from fedudp.run import run

    root = tiny_mnist(tmp_path / "data")
    calls = []
    orig = batched.one_step_vectors
    monkeypatch.setattr(
        batched, "one_step_vectors", lambda *a, **k: calls.append(len(a[5])) or orig(*a, **k)
    )
    out = {}
    for flag in (True, False):
        owners_take(monkeypatch, Kernels(one_step=flag))
        cfg = tiny_cfg(
            "fedavg",
            dataset__name="mnist",
            dataset__root=str(root),
            model__name="cnn",
            dataset__num_records=300,
            partition__num_owners=8,
            train__rounds=2,
            train__batch_size=batch,
        )
        out[flag] = run(cfg, tmp_path / str(flag))
    owners_per_round = 8 if batch == 40 else 4
    assert sum(calls) == 2 * owners_per_round  # both rounds, exactly those owners
    assert out[True]["accuracy_mean"] == pytest.approx(out[False]["accuracy_mean"], abs=1e-9)
    assert out[True]["loss"] == pytest.approx(out[False]["loss"], rel=1e-5)


def test_multi_record_users_in_float64_parameters_through_a_float32_module():
    """Float64 parameters run through a float32 module (functional_call): the multi-record
    users' vectors, per-user convolution weight gradients included, are the float64 deltas."""
    torch.manual_seed(2)
    model = PaperCNN()  # float32 module
    x, y, params, starts, sizes = _setup(PaperCNN().double(), [3, 1, 4], (1, 28, 28))
    names = tuple(params)
    got = one_step_vectors(model, params, x, y, starts, sizes, names, -0.05)
    assert got.dtype == torch.float64
    _, _, ref = _reference(PaperCNN().double(), params, x, y, starts, sizes, names, 0.05, 1.0)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-13)
