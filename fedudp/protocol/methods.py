"""The four methods as configurations of one algorithm
(docs/algorithms.md#joint-dp-and-the-four-methods).

| method   | shared        | personal               | server release           |
|----------|---------------|------------------------|--------------------------|
| per_silo | none          | all parameters         | none (no communication)  |
| fedavg   | all           | none                   | mean of owners' deltas   |
| full_dp  | all           | none                   | DP (see ``update``)      |
| joint_dp | the rest      | ``model.personal``     | DP on shared (``update``)|

``update``, what an owner computes for the billboard: ``user_vectors`` (each sampled user's
delta or gradient; the billboard's aggregator adds the noise: ``privacy.placement=server``),
``owner_sgd`` (standard FedAvg: the owner's delta after E epochs of SGD on all its records), or
``owner_dpsgd`` (the owner's delta after E epochs of DP-SGD over its users:
``privacy.placement=local_dpsgd``, the owner-side reading of Huang et al. §4).

``feedback``: whether each shared vector is computed at the owner's own personal parameters
(paper reading, heuristic at user level, docs/algorithms.md#certified-vs-paper-accounting) or
at a public copy (certified); owner-level accounting allows the feedback (it stays inside the
unit).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedudp.models.split import ParamSplit, SplitModel, split_by_patterns
from fedudp.protocol.choices import Method, Placement, Unit

__all__ = ["MethodSpec", "make_method"]


@dataclass(frozen=True)
class MethodSpec:
    """What a method is: its split, its privacy and what its owners send.

    Parameters
    ----------
    method : Method
        per_silo, fedavg, full_dp or joint_dp.
    split : ParamSplit
        The shared and personal parameters.
    private : bool
        Its releases are private (a ledger).
    communicates : bool
        The owners send updates.
    feedback : bool
        Shared vectors computed at the owner's own personal parameters.
    unit : Unit
        The privacy unit of the release (user or owner).
    guarantee : str
        ``certified``, ``heuristic`` or ``none``.
    update : str, default "user_vectors"
        user_vectors, owner_sgd or owner_dpsgd (the module docstring).
    """

    method: Method
    split: ParamSplit
    private: bool
    communicates: bool
    feedback: bool  # shared vectors computed at the owner's own personal params
    unit: Unit  # privacy unit of the release (user or owner)
    guarantee: str  # "certified" | "heuristic" | "none"
    update: str = "user_vectors"  # user_vectors | owner_sgd | owner_dpsgd (see the module doc)

    @property
    def cohort_is_owners(self) -> bool:
        """The billboard samples owners (owner level, or owner-level updates), not users."""
        return self.unit == Unit.owner or self.update != "user_vectors"

    @property
    def shared(self) -> tuple[str, ...]:
        return self.split.shared

    @property
    def personal(self) -> tuple[str, ...]:
        return self.split.personal


def make_method(
    method: str,
    model: SplitModel,
    *,
    personal: tuple[str, ...] = (),
    unit: str = "user",
    placement: str = "server",
    paper: bool = False,
) -> MethodSpec:
    """The method's split, privacy and update from plain values: ``method`` (per_silo, fedavg,
    full_dp, joint_dp), the model, joint-DP's personal parameter patterns (empty: the model's
    default), the privacy ``unit`` (user, record, owner), where the noise is added
    (``placement``: server, local_dpsgd) and whether accounting follows the paper (``paper``:
    shared vectors at the owner's own personal parameters). A split that leaves no personal or
    no shared parameter for joint_dp is a ``ValueError``.

    Parameters
    ----------
    method : str
        per_silo, fedavg, full_dp or joint_dp.
    model : SplitModel
        The model.
    personal : tuple of str, default ()
        Joint DP's personal parameter patterns (empty: the model's default).
    unit : str, default "user"
        The privacy unit: user, record or owner.
    placement : str, default "server"
        Where the noise is added: server or local_dpsgd.
    paper : bool, default False
        Accounting as in the paper (shared vectors at the owner's own personal parameters).

    Returns
    -------
    MethodSpec
        The method.

    Raises
    ------
    ValueError
        A joint_dp split that leaves no personal or no shared parameter.
    """
    m = Method(method)
    names = tuple(n for n, _ in model.named_parameters())
    release_unit = Unit.owner if Unit(unit) == Unit.owner else Unit.user
    if m == Method.per_silo:
        return MethodSpec(m, ParamSplit((), names), False, False, False, release_unit, "none")
    update = "owner_dpsgd" if Placement(placement) == Placement.local_dpsgd else "user_vectors"
    if m == Method.fedavg:
        return MethodSpec(
            m, ParamSplit(names, ()), False, True, False, release_unit, "none", "owner_sgd"
        )
    if m == Method.full_dp:
        return MethodSpec(
            m, ParamSplit(names, ()), True, True, False, release_unit, "certified", update
        )
    patterns = list(personal) or list(model.default_personal)
    if not patterns:
        raise ValueError("joint_dp needs at least one personal parameter pattern")
    split = split_by_patterns(model, patterns)
    if not split.shared:
        raise ValueError(
            f"{patterns} makes every parameter personal; joint_dp needs shared "
            "parameters (use method=per_silo for none)"
        )
    feedback = paper or release_unit == Unit.owner
    guarantee = "heuristic" if (paper and release_unit != Unit.owner) else "certified"
    return MethodSpec(m, split, True, True, feedback, release_unit, guarantee, update)
