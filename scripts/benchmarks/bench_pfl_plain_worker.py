"""The ``plain`` side of ``scripts/benchmarks/bench_pfl.py``: the same user-level DP FedAvg rounds written as
a bare PyTorch loop, the compute floor both frameworks are measured against.

It imports nothing from fedudp except the model class (``fedudp.models.cnn.PaperCNN``) and
reads the workload file ``bench_pfl.py`` prepares (the users, records, test records and initial
weights of fedudp's and pfl's runs). One round, every user in turn:

* the model's parameters are set to the global ones (``copy_``);
* one local epoch (``--epochs``) of ``torch.optim.SGD`` (lr ``--lr``, no momentum) over the
  user's records in minibatches of ``--batch`` (a permutation per user from one seeded
  generator), the loss the batch-mean cross entropy;
* the user's model difference (local - global) flattened into one buffer, its l2 norm computed
  in float64 and the difference scaled by min(1, clip / norm), added to a running float64 sum;

then N(0, (z * clip)^2) per coordinate (float64, seeded) is added to the sum, divided by the
number of users, and added to the global parameters times ``--server-lr``. No sampling, no
non-finite screening, no accounting and no bookkeeping: nothing a framework adds. Seconds per
round are timed around exactly that; the test accuracy after the last round is not timed.

    .venv/bin/python scripts/benchmarks/bench_pfl_plain_worker.py --workload W.npz --rounds 4 ... --out r.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pfl_args import start_worker, status_kib  # noqa: E402  (this folder)


def main() -> None:
    a = start_worker(__doc__.splitlines()[0])  # one thread, the repository on sys.path

    import numpy as np
    import torch
    import torch.nn.functional as F

    from fedudp.models.cnn import PaperCNN

    w = np.load(a.workload)
    x = torch.from_numpy(np.ascontiguousarray(w["x"]))
    y = torch.from_numpy(np.ascontiguousarray(w["y"]).astype(np.int64))
    offs = w["user_offsets"].astype(np.int64)
    num_users = len(offs) - 1
    net = PaperCNN(x.shape[1], int(w["classes"]), x.shape[2])
    init = {k[len("init/") :]: torch.from_numpy(w[k]) for k in w.files if k.startswith("init/")}
    net.load_state_dict(init, strict=True)
    params = [p for p in net.parameters()]
    glob = [p.detach().clone() for p in params]
    d = sum(p.numel() for p in params)
    delta = torch.empty(d, dtype=params[0].dtype)
    opt = torch.optim.SGD(params, lr=a.lr)
    gen = torch.Generator().manual_seed(a.seed)
    noise_gen = torch.Generator().manual_seed(a.seed + 1)
    steps = 0

    seconds: list[float] = []
    clipped: list[float] = []
    rss_before, hwm_before = status_kib("VmRSS"), status_kib("VmHWM")
    wall0 = time.time()
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        total = torch.zeros(d, dtype=torch.float64)
        n_clipped = 0
        for u in range(num_users):
            a0, a1 = int(offs[u]), int(offs[u + 1])
            with torch.no_grad():
                for p, g in zip(params, glob):
                    p.copy_(g)
            for _ in range(a.epochs):
                perm = torch.randperm(a1 - a0, generator=gen) + a0
                for s in range(0, a1 - a0, a.batch):
                    idx = perm[s : s + a.batch]
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(net(x[idx]), y[idx]).backward()
                    opt.step()
                    steps += 1
            with torch.no_grad():
                torch.cat([(p - g).reshape(-1) for p, g in zip(params, glob)], out=delta)
                norm = float(torch.linalg.vector_norm(delta, dtype=torch.float64))
                factor = min(1.0, a.clip / norm) if norm > 0 else 1.0
                n_clipped += factor < 1.0
                total.add_(delta, alpha=factor)
        total.add_(
            torch.normal(
                0.0, a.noise_multiplier * a.clip, (d,), generator=noise_gen, dtype=torch.float64
            )
        )
        mean = total / num_users
        with torch.no_grad():
            at = 0
            for p, g in zip(params, glob):
                g.add_((a.server_lr * mean[at : at + g.numel()]).view_as(g).to(g.dtype))
                p.copy_(g)
                at += g.numel()
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
        np.savez(a.final_params, **{k: v.detach().numpy() for k, v in net.state_dict().items()})
    sizes = np.diff(offs)
    nsteps = a.epochs * (-(-sizes // a.batch))
    Path(a.out).write_text(
        json.dumps(
            {
                "side": "plain",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
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
                    "counted": steps / (num_users * a.rounds),
                    "source": "ceil(records / batch) x epochs; counted: SGD steps per trained user",
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
