"""The ClientApp: Flower's PyTorch quickstart shape. The fedudp lines: the mod, and the
evaluation loading all of the client's users (``client_users``: in training the mod hands the
app one user's index as ``partition-id``; evaluation sees the client's whole data)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedudp.flower import client_users, user_level_mod  # fedudp
from fedudp.flower.fast import TorchTraining  # fedudp
from user_dp_app.task import evaluate, load_data, make_model, train

# fedudp: the mod (the run config may set users-per-client); fast=: train_fn below is plain
# PyTorch SGD (task.train: one full-batch step at the server's lr), so the mod computes all
# sampled users' updates at once instead of calling train_fn once per user
fast = TorchTraining(make_model, load_data, lr="lr")  # fedudp
app = ClientApp(mods=[user_level_mod(users_per_client=10, fast=fast)])  # fedudp


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_data(context.node_config["partition-id"], context.node_config["num-partitions"])
    loss = train(model, x, y, lr=float(msg.content["config"]["lr"]))
    return Message(
        RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"train_loss": loss, "num-examples": len(y)}),
            }
        ),
        reply_to=msg,
    )


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    users, n = client_users(context)  # fedudp: all of this client's users' data
    x, y = map(torch.cat, zip(*(load_data(u, n) for u in users)))  # fedudp
    loss, acc = evaluate(model, x, y)
    return Message(
        RecordDict(
            {"metrics": MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(y)})}
        ),
        reply_to=msg,
    )
