"""The four methods as configurations of one algorithm (ARCHITECTURE.md §1, ALGORITHMS.md §3.6).

| method   | shared        | personal               | server release           |
|----------|---------------|------------------------|--------------------------|
| per_silo | none          | all parameters         | none (no communication)  |
| fedavg   | all           | none                   | plain mean (no DP)       |
| full_dp  | all           | none                   | DP aggregator            |
| joint_dp | the rest      | ``model.personal``     | DP aggregator on shared  |

``feedback``: whether each shared vector is computed at the owner's own personal parameters
(paper reading, heuristic at user level, ALGORITHMS.md §3.2 caveat) or at a public copy
(certified option (c)); owner-level accounting (option (a)) allows the feedback.
"""
from __future__ import annotations

from dataclasses import dataclass

from fedudp.config import Accounting, ConfigError, Method, RunConfig, Unit
from fedudp.models.split import ParamSplit, SplitModel, split_by_patterns


@dataclass(frozen=True)
class MethodSpec:
    method: Method
    split: ParamSplit
    private: bool
    communicates: bool
    feedback: bool          # shared vectors computed at the owner's own personal params
    unit: Unit              # privacy unit of the release (user or owner)
    guarantee: str          # "certified" | "heuristic" | "none"

    @property
    def shared(self) -> tuple[str, ...]:
        return self.split.shared

    @property
    def personal(self) -> tuple[str, ...]:
        return self.split.personal


def method_spec(cfg: RunConfig, model: SplitModel) -> MethodSpec:
    m = Method(cfg.method)
    names = tuple(n for n, _ in model.named_parameters())
    unit = Unit(cfg.privacy.unit)
    release_unit = Unit.owner if unit == Unit.owner else Unit.user
    if m == Method.per_silo:
        return MethodSpec(m, ParamSplit((), names), False, False, False, release_unit, "none")
    if m in (Method.fedavg, Method.full_dp):
        private = m == Method.full_dp
        return MethodSpec(m, ParamSplit(names, ()), private, True, False, release_unit,
                          "certified" if private else "none")
    patterns = list(cfg.model.personal) or list(model.default_personal)
    if not patterns:
        raise ConfigError("model.personal: joint_dp needs at least one personal parameter pattern")
    split = split_by_patterns(model, patterns)
    if not split.shared:
        raise ConfigError(f"model.personal: {patterns} makes every parameter personal; "
                          "joint_dp needs shared parameters (use method=per_silo for none)")
    paper = Accounting(cfg.privacy.accounting) == Accounting.paper
    feedback = paper or release_unit == Unit.owner
    guarantee = "heuristic" if (paper and release_unit != Unit.owner) else "certified"
    return MethodSpec(m, split, True, True, feedback, release_unit, guarantee)
