"""The batched per-sample floors of ``scripts/benchmarks/bench_pfl.py`` (sides ``opacus`` and
``vmap``): the same user-level DP FedAvg rounds as the ``plain`` side, every user's clipped delta
computed from one batched per-sample gradient pass instead of a loop over users.

Valid only where every user takes one local step (records <= ``--batch``, ``--epochs 1``; the
worker refuses anything else): a user's delta is then -lr x the mean of its records' loss
gradients at the global weights (one record: -lr x that record's gradient). One round:

* the users, grouped by size s, in chunks of about ``--chunk`` records (whole users);
* per chunk, the per-record gradients of the summed cross entropy at the global weights:
  ``--mode opacus``: ``opacus.GradSampleModule(loss_reduction="sum")`` around an NCHW copy of the
  model (``PaperCNN(channels_last=False)``, the same weights: Opacus 1.6 returns wrong
  per-sample gradients for the channels-last default, see fedudp/models/cnn.py), then each
  user's s rows summed and scaled by -lr / s; ``--mode vmap``: ``torch.func.vmap(grad(loss))``
  over the users (``functional_call``, the loss each user's mean cross entropy over its s
  records), scaled by -lr;
* each user's delta's l2 norm in float64, the delta scaled by min(1, clip / norm), the chunk's
  scaled deltas summed into a float64 total;

then the noise exactly as the plain side draws it (float64, the same generator seed, so at any z
this side's final weights equal plain's up to float rounding), divided by the number of users,
added to the weights times ``--server-lr``. Seconds per round are timed around exactly that;
the test accuracy after the last round is not timed. Opacus is not a fedudp dependency:
``.venv/bin/pip install opacus==1.6.0`` (``bench_pfl.py`` skips the side when it is missing).

    .venv/bin/python scripts/benchmarks/bench_pfl_floor_worker.py --mode vmap --workload W.npz \\
        --rounds 4 ... --out r.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pfl_args import start_worker, status_kib  # noqa: E402  (this folder)


def _extra(ap) -> None:
    ap.add_argument("--mode", choices=["opacus", "vmap"], required=True)
    ap.add_argument("--chunk", type=int, default=256, help="records per batched pass")


def main() -> None:
    a = start_worker(__doc__.splitlines()[0], _extra)  # one thread, the repository on sys.path

    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    from fedudp.models.cnn import PaperCNN

    w = np.load(a.workload)
    x = torch.from_numpy(np.ascontiguousarray(w["x"]))
    y = torch.from_numpy(np.ascontiguousarray(w["y"]).astype(np.int64))
    offs = w["user_offsets"].astype(np.int64)
    sizes = np.diff(offs)
    num_users = len(sizes)
    if a.epochs != 1 or int(sizes.max()) > a.batch:
        raise SystemExit(
            f"bench_pfl_floor_worker.py: error: the batched floors need one local step per user "
            f"(--epochs 1 and every user <= --batch records); got --epochs {a.epochs}, users of "
            f"up to {int(sizes.max())} records, --batch {a.batch}"
        )
    # NCHW throughout for Opacus; under vmap the switch is inert (torch.func keeps NCHW)
    net = PaperCNN(x.shape[1], int(w["classes"]), x.shape[2], channels_last=False)
    init = {k[len("init/") :]: torch.from_numpy(w[k]) for k in w.files if k.startswith("init/")}
    net.load_state_dict(init, strict=True)
    names = [k for k, _ in net.named_parameters()]
    params = [p for _, p in net.named_parameters()]
    d = sum(p.numel() for p in params)
    # users grouped by size: (s, records [n_s, s, C, H, W], labels [n_s, s])
    groups = []
    for s in sorted({int(v) for v in sizes}):
        users = np.flatnonzero(sizes == s)
        idx = torch.from_numpy(offs[users][:, None] + np.arange(s)[None, :])
        groups.append((s, x[idx], y[idx]))

    if a.mode == "opacus":
        try:
            import opacus
        except ImportError:
            raise SystemExit(
                "bench_pfl_floor_worker.py: error: opacus is not installed "
                "(.venv/bin/pip install opacus==1.6.0)"
            ) from None
        gsm = opacus.GradSampleModule(net, loss_reduction="sum")

        def user_grads(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            """[n, s, ...] records of n users -> [n, d] mean gradients (float32)."""
            n, s = ys.shape
            F.cross_entropy(
                gsm(xs.reshape(n * s, *xs.shape[2:])), ys.reshape(-1), reduction="sum"
            ).backward()
            rows = torch.cat([p.grad_sample.reshape(n * s, -1) for p in params], 1)  # type: ignore[union-attr]
            for p in params:
                p.grad_sample = None
                p.grad = None
            return rows if s == 1 else rows.view(n, s, d).sum(1).div_(s)

    else:
        fparams = {k: p.detach() for k, p in zip(names, params)}

        def loss(pd: dict, xu: torch.Tensor, yu: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(net, pd, (xu,)), yu)

        per_user = vmap(grad(loss), in_dims=(None, 0, 0))

        def user_grads(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            g = per_user(fparams, xs, ys)
            return torch.cat([g[k].reshape(ys.shape[0], -1) for k in names], 1)

    noise_gen = torch.Generator().manual_seed(a.seed + 1)  # as the plain side draws it
    seconds: list[float] = []
    clipped: list[float] = []
    rss_before, hwm_before = status_kib("VmRSS"), status_kib("VmHWM")
    wall0 = time.time()
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        total = torch.zeros(d, dtype=torch.float64)
        n_clipped = 0
        for s, xs, ys in groups:
            step = max(1, a.chunk // s)
            for c in range(0, len(ys), step):
                deltas = user_grads(xs[c : c + step], ys[c : c + step]).mul_(-a.lr)
                norms = torch.linalg.vector_norm(deltas, dim=1, dtype=torch.float64)
                factor = torch.where(
                    norms > 0, (a.clip / norms).clamp(max=1.0), torch.ones_like(norms)
                )
                n_clipped += int((factor < 1.0).sum())
                total += factor @ deltas.double()
        total.add_(
            torch.normal(
                0.0, a.noise_multiplier * a.clip, (d,), generator=noise_gen, dtype=torch.float64
            )
        )
        mean = total / num_users
        with torch.no_grad():
            at = 0
            for p in params:
                p.add_((a.server_lr * mean[at : at + p.numel()]).view_as(p).to(p.dtype))
                at += p.numel()
        seconds.append(time.perf_counter() - t0)
        clipped.append(n_clipped / num_users)

    with torch.no_grad():
        xt = torch.from_numpy(np.ascontiguousarray(w["x_test"]))
        yt = torch.from_numpy(w["y_test"].astype(np.int64))
        correct = sum(
            int((net(xt[i : i + 1000]).argmax(1) == yt[i : i + 1000]).sum())
            for i in range(0, len(yt), 1000)
        )
    wall1 = time.time()
    if a.final_params:
        np.savez(a.final_params, **{k: p.detach().numpy() for k, p in zip(names, params)})
    nsteps = a.epochs * (-(-sizes // a.batch))
    Path(a.out).write_text(
        json.dumps(
            {
                "side": a.mode,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "chunk_records": a.chunk,
                "round_seconds": seconds,
                "rounds_wall": [wall0, wall1],
                "users": num_users,
                "records": int(offs[-1]),
                "users_per_round": [num_users] * a.rounds,
                "clipped_fraction": clipped,
                "local_steps_per_user": {
                    "min": int(nsteps.min()),
                    "max": int(nsteps.max()),
                    "mean": float(nsteps.mean()),
                    "source": "one step per user (checked: records <= batch, one epoch)",
                },
                "final_accuracy": correct / len(yt),
                "test_records": int(len(yt)),
                "rss_before_rounds_mib": rss_before / 1024,
                "hwm_before_rounds_mib": hwm_before / 1024,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
