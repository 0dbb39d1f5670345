"""The pfl-research side of ``scripts/benchmarks/bench_pfl.py``: one repetition (R rounds) of user-level DP
FedAvg through pfl's own public API, run with pfl's Python (``--pfl-python``), not fedudp's.

It imports nothing from fedudp except the model class (``fedudp.models.cnn.PaperCNN``, the
repository root put on ``sys.path``; that module needs only torch). Everything else comes from
the prepared workload file ``bench_pfl.py`` writes (the same users, records, test records and
initial weights fedudp's run uses):

* data: ``pfl.data.federated_dataset.FederatedDataset`` (user id -> ``pfl.data.dataset.Dataset``
  of that user's records, torch tensors sliced from one array), users drawn by pfl's
  ``minimize_reuse`` sampler, cohort = every user, so every round trains every user once;
* model: ``pfl.model.pytorch.PyTorchModel`` around ``PaperCNN`` (a subclass adding only the
  ``loss`` / ``metrics`` methods pfl's PyTorch models declare), local optimizer
  ``torch.optim.SGD``, central optimizer ``torch.optim.SGD(lr=server_lr)``;
* algorithm: ``pfl.algorithm.FederatedAveraging`` with ``NNAlgorithmParams`` /
  ``NNTrainHyperParams`` (one local epoch, batch 32, local lr);
* privacy: ``CentrallyAppliedPrivacyMechanism(GaussianMechanism(clip, z))`` as the backend's
  postprocessor: each user's model difference clipped to l2 norm ``clip``, the sum noised with
  N(0, (z * clip)^2) per coordinate, averaged over the users (weight 1 each), applied by the
  central SGD step;
* backend: ``pfl.aggregate.simulate.SimulatedBackend`` (one process, no workers).

Seconds per round: a ``TrainingProcessCallback`` (the span pfl's own ``StopwatchCallback``
times): ``on_train_begin`` to the first ``after_central_iteration``, then between consecutive
``after_central_iteration`` calls: sampling, local training of every user, clipping,
summation, noise, averaging, the central update and pfl's per-round metric bookkeeping. The
test accuracy is computed after the last round (``PyTorchModel.evaluate``), not timed.

    PFL_PYTHON scripts/benchmarks/bench_pfl_worker.py --workload W.npz --rounds 4 --out result.json
"""

from __future__ import annotations

import json
import logging
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

    logging.basicConfig(level=logging.WARNING)

    # the one thing taken from fedudp: the model class (fedudp/models/cnn.py needs only torch)
    from fedudp.models.cnn import PaperCNN

    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism

    np.random.seed(a.seed)
    torch.manual_seed(a.seed)

    class PflPaperCNN(PaperCNN):
        """fedudp's PaperCNN (same layers and forward) with the two methods pfl's
        ``PyTorchModel`` calls: ``loss`` (the batch-mean cross entropy SGD minimises, as in
        fedudp) and ``metrics`` (summed loss and correct predictions, weighted by records)."""

        steps = 0  # local SGD steps taken (pfl calls ``loss`` once per step)

        def loss(self, x, y, eval=False):  # noqa: A002 (pfl's keyword)
            PflPaperCNN.steps += 1
            self.eval() if eval else self.train()
            return F.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=True):  # noqa: A002
            self.eval() if eval else self.train()
            logits = self(x)
            n = len(y)
            return {
                "loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), n),
                "accuracy": Weighted(float((logits.argmax(1) == y).sum()), n),
            }

    # -- the workload: the same users, records and initial weights as fedudp's run ------------
    w = np.load(a.workload)
    x = torch.from_numpy(np.ascontiguousarray(w["x"]))
    y = torch.from_numpy(np.ascontiguousarray(w["y"]).astype(np.int64))
    offs = w["user_offsets"].astype(np.int64)
    num_users = len(offs) - 1
    user_ids = list(range(num_users))

    def make_user(uid: int) -> Dataset:
        a0, a1 = int(offs[uid]), int(offs[uid + 1])
        return Dataset(raw_data=(x[a0:a1], y[a0:a1]), user_id=uid)

    train_data = FederatedDataset(make_user, get_user_sampler("minimize_reuse", user_ids))
    test_set = Dataset(
        raw_data=(
            torch.from_numpy(np.ascontiguousarray(w["x_test"])),
            torch.from_numpy(w["y_test"].astype(np.int64)),
        )
    )

    net = PflPaperCNN(x.shape[1], int(w["classes"]), x.shape[2])
    init = {k[len("init/") :]: torch.from_numpy(w[k]) for k in w.files if k.startswith("init/")}
    net.load_state_dict(init, strict=True)
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=a.server_lr),
    )

    mechanism = CentrallyAppliedPrivacyMechanism(
        GaussianMechanism(clipping_bound=a.clip, relative_noise_stddev=a.noise_multiplier)
    )
    backend = SimulatedBackend(
        training_data=train_data, val_data=train_data, postprocessors=[mechanism]
    )
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=a.rounds,
        evaluation_frequency=a.rounds + 1,  # pfl evaluates iteration 0's users (round 1 only)
        train_cohort_size=num_users,  # every user, every round
        val_cohort_size=None,
    )
    train_params = NNTrainHyperParams(
        local_learning_rate=a.lr, local_num_epochs=a.epochs, local_batch_size=a.batch
    )

    class RoundTimer(TrainingProcessCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.metrics: list[dict] = []

        def on_train_begin(self, *, model):
            self.t = time.perf_counter()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            t = time.perf_counter()
            self.seconds.append(t - self.t)
            self.t = t
            self.metrics.append(
                {
                    str(k): float(v)
                    for k, v in aggregate_metrics.to_simple_dict(
                        force_serialize_all_metrics=True
                    ).items()
                }
            )
            return False, Metrics()

    timer = RoundTimer()
    rss_before = status_kib("VmRSS")
    hwm_before = status_kib("VmHWM")
    wall0 = time.time()
    model = FederatedAveraging().run(
        algorithm_params=algorithm_params,
        backend=backend,
        model=model,
        model_train_params=train_params,
        callbacks=[timer],
    )
    ev = model.evaluate(test_set, eval_params=NNEvalHyperParams(local_batch_size=1000))
    wall1 = time.time()
    ev = {str(k): float(v) for k, v in ev.to_simple_dict().items()}
    acc = next(v for k, v in ev.items() if "accuracy" in k.lower())

    def pick(m: dict, needle: str):
        hits = [v for k, v in m.items() if needle in k.lower()]
        return hits[0] if hits else None

    if a.final_params:
        np.savez(a.final_params, **{k: v.detach().numpy() for k, v in net.state_dict().items()})
    sizes = np.diff(offs)
    steps = a.epochs * (-(-sizes // a.batch))
    users_per_round = [pick(m, "number of devices") for m in timer.metrics]
    out = {
        "side": "pfl",
        "pfl_version": pfl.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "round_seconds": timer.seconds,
        "rounds_wall": [wall0, wall1],
        "users": num_users,
        "records": int(offs[-1]),
        "users_per_round": users_per_round,
        "records_per_round": [pick(m, "number of data points") for m in timer.metrics],
        "clipped_fraction": [pick(m, "fraction of clipped norms") for m in timer.metrics],
        "local_steps_per_user": {
            "min": int(steps.min()),
            "max": int(steps.max()),
            "mean": float(steps.mean()),
            "counted": PflPaperCNN.steps / sum(users_per_round),
            "source": "ceil(records / batch) x epochs; counted: calls of loss() per trained user",
        },
        "final_accuracy": acc,
        "test_records": int(len(w["y_test"])),
        "rss_before_rounds_mib": rss_before / 1024,
        "hwm_before_rounds_mib": hwm_before / 1024,
        "round_metrics": timer.metrics,
    }
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
