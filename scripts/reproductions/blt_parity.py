"""ε parity of ``aggregator=dp_mf_blt`` with a published BLT setting of the reference.

The published setting is Google's federated-compute BLT accounting test (repository
google-parfait/federated-compute, ``fcp/confidentialcompute/python/accounting_test.py``,
``AccountingTest.test_zcdp_for_blt``, commit 86887cbc804a, unchanged at de83f70c3b35, and its
inverse ``test_noise_multiplier_for_blt``, commit 3ee822d13772): a 4-buffer BLT (jax_privacy's
``BufferedToeplitz``, θ = ``buf_decay``, ω = ``output_scale``), n = 100 steps, min-separation
b = 50, at most 2 participations, noise multiplier 1.0 (noise std / clip) → ρ-zCDP 3.17226586;
and ρ = 3.17226586 → noise multiplier 1.0.

fedudp's side: ``BltAggregator`` (n = 100, rate 1/50 so b = 50, 4 buffers) going on with the
published θ, ω (``restore_checkpoint_state``, as a resumed run does), at the published noise
std: its sensitivity, the ρ = 1 / (2 z²) of its one ``GaussianDpEvent(z)``, the noise std it
releases at the published ρ, and its ledger ε (``fedudp.privacy.accountant``: PLD, RDP as the
cross-check) at δ = 1e-5 and 1e-10 against the ε of the published ρ: the exact ε of the
Gaussian with that ρ (Balle & Wang 2018, Theorem 8) and dp-accounting's RDP conversion of
RDP(α) = α·ρ (same orders). The weakened twins of tests/privacy/test_blt_parity.py are shown
beside. Writes ``blt_parity.json`` and README.md's ``blt:parity`` block in
docs/results/beyond_seeds/; a few seconds, no training:

    .venv/bin/python scripts/reproductions/blt_parity.py
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from beyond_seeds import OUT, analytic_gaussian_epsilon  # noqa: E402

SOURCE = (
    "google-parfait/federated-compute fcp/confidentialcompute/python/accounting_test.py "
    "AccountingTest.test_zcdp_for_blt (86887cbc804a; unchanged at de83f70c3b35) and "
    "test_noise_multiplier_for_blt (3ee822d13772)"
)
THETA = (0.9999999999921251, 0.9944453083640997, 0.8985923474607591, 0.4912001418098778)
OMEGA = (0.0070314825502323835, 0.10613806907600574, 0.1898159060327625, 0.1966594748073734)
ROUNDS, MIN_SEP, K, Z, RHO = 100, 50, 2, 1.0, 3.17226586
DELTAS = (1e-5, 1e-10)


def build(z: float, sens2=None):
    """fedudp's BLT for the setting (clip 1) at its noise multiplier ``z`` = σ / (sens·clip),
    going on with the published θ, ω; ``sens2``: a twin's sensitivity in place of its own."""
    import fedudp.aggregators.blt as blt_module
    from fedudp.aggregators import BltAggregator, Sampling

    own = blt_module.minsep_sensitivity_squared
    if sens2 is not None:
        blt_module.minsep_sensitivity_squared = sens2
    try:
        state = {"t": 0, "buffers": None, "theta": list(THETA), "omega": list(OMEGA)}
        agg = BltAggregator.with_noise_multiplier(
            z, clip=1.0, sampling=Sampling(1.0 / MIN_SEP, 200), rounds=ROUNDS, buffers=4
        )
        agg.restore_checkpoint_state(state)
        return agg
    finally:
        blt_module.minsep_sensitivity_squared = own


def released(noise_over_clip: float, sens2=None):
    """``build`` at noise std ``noise_over_clip``·clip (the reference's noise multiplier)."""
    return build(noise_over_clip / build(1.0, sens2).sensitivity, sens2)


def ledger(agg, deltas=DELTAS) -> dict:
    """The run's events through fedudp's accountant: ρ, and (PLD, RDP) ε at each δ."""
    from fedudp.privacy.accountant import accountant_for

    events = [agg.round_event(r) for r in range(1, ROUNDS + 1)]
    acc = accountant_for(agg.dp_event())
    for e in events:
        acc.compose(e)
    z = events[0].noise_multiplier
    return {
        "z": z,
        "rho": 1.0 / (2.0 * z * z),
        "eps": {d: (acc.epsilon(d), acc.epsilon_rdp(d)) for d in deltas},
    }


def twins() -> dict:
    """The weakened twins' ρ at the published noise (tests/privacy/test_blt_parity.py)."""
    import numpy as np

    def one_participation(c, b, n):
        c = np.asarray(c, dtype=np.float64)[:n]
        return float(c @ c)

    def late_pattern(c, b, n):
        c, v = np.asarray(c, dtype=np.float64)[:n], np.zeros(n)
        for start in range(b - 1, n, b):
            v[start:] += c[: n - start]
        return float(v @ v)

    k1 = ledger(released(Z, one_participation), ())["rho"]
    late = ledger(released(Z, late_pattern), ())["rho"]
    agg = released(Z)  # the third twin's event: GaussianDpEvent(σ / clip) instead of z
    return {
        "sensitivity of one participation (k = 1)": k1,
        "sensitivity from the pattern b-1, 2b-1, ...": late,
        "event without the sensitivity (z = sigma/clip)": 0.5 / (agg.noise_std / agg.clip) ** 2,
    }


def compute() -> dict:
    from dp_accounting.rdp import rdp_privacy_accountant

    from fedudp.privacy.blt import max_participations
    from fedudp.privacy.bounded import rdp_accountant

    agg = released(Z)
    led = ledger(agg)
    at_target = build(1.0 / math.sqrt(2.0 * RHO))  # the published ρ as fedudp's target
    orders = rdp_accountant().orders
    eps = []
    for d in DELTAS:
        pld, rdp = led["eps"][d]
        pub_rdp = float(
            rdp_privacy_accountant.compute_epsilon(orders, [a * RHO for a in orders], d)[0]
        )
        eps.append(
            {
                "delta": d,
                "ledger_pld": pld,
                "published_rho_exact": analytic_gaussian_epsilon(1.0 / math.sqrt(2.0 * RHO), d),
                "ledger_rdp": rdp,
                "published_rho_rdp": pub_rdp,
                "zcdp_bound": RHO + 2.0 * math.sqrt(RHO * math.log(1.0 / d)),
            }
        )
    return {
        "source": SOURCE,
        "setting": {"theta": THETA, "omega": OMEGA, "n": ROUNDS, "b": MIN_SEP, "k": K, "z": Z},
        "k_fedudp": max_participations(ROUNDS, MIN_SEP),
        "sensitivity_squared": agg.sensitivity**2,
        "published_sensitivity_squared": 2.0 * RHO * Z * Z,
        "rho": led["rho"],
        "published_rho": RHO,
        "noise_over_clip_at_rho": at_target.noise_std,
        "noise_std_at_z": agg.noise_std,
        "epsilon": eps,
        "twins_rho": twins(),
    }


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def markdown(data: dict) -> list[str]:
    """README.md's ``blt:parity`` block."""
    lines = [
        "| quantity | published | fedudp | relative difference |",
        "|---|---:|---:|---:|",
        f"| k = ⌈n/b⌉ | {data['setting']['k']} | {data['k_fedudp']} | — |",
    ]
    for name, pub, ours in (
        ("sens² = 2ρz²", data["published_sensitivity_squared"], data["sensitivity_squared"]),
        ("ρ at noise multiplier 1", data["published_rho"], data["rho"]),
        ("noise std / clip at ρ = 3.17226586", 1.0, data["noise_over_clip_at_rho"]),
    ):
        lines.append(f"| {name} | {pub:.8f} | {ours:.10f} | {rel(ours, pub):.1e} |")
    lines += [
        "",
        "| δ | ledger ε (PLD) | exact ε of the published ρ | rel. diff | ledger ε (RDP) "
        "| RDP ε of the published ρ | rel. diff | ρ + 2√(ρ ln 1/δ) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in data["epsilon"]:
        lines.append(
            f"| {e['delta']:g} | {e['ledger_pld']:.6f} | {e['published_rho_exact']:.6f} "
            f"| {rel(e['ledger_pld'], e['published_rho_exact']):.1e} | {e['ledger_rdp']:.6f} "
            f"| {e['published_rho_rdp']:.6f} | {rel(e['ledger_rdp'], e['published_rho_rdp']):.1e} "
            f"| {e['zcdp_bound']:.4f} |"
        )
    lines += [
        "",
        "| weakened twin (tests/privacy/test_blt_parity.py) | its ρ at noise multiplier 1 |",
    ]
    lines.append("|---|---:|")
    lines += [f"| {k} | {v:.6f} |" for k, v in data["twins_rho"].items()]
    lines.append("")
    lines.append(f"Wall time {data['wall_s']} s.")
    return lines


def main() -> None:
    t0 = time.time()
    data = compute()
    data["wall_s"] = round(time.time() - t0, 1)
    data["epsilon"] = [
        {k: (float(v) if k != "delta" else v) for k, v in e.items()} for e in data["epsilon"]
    ]
    (OUT / "blt_parity.json").write_text(json.dumps(data, indent=1) + "\n")
    readme = OUT / "README.md"
    text = readme.read_text()
    block = "<!-- blt:parity -->\n" + "\n".join(markdown(data)) + "\n<!-- /blt:parity -->"
    if "<!-- blt:parity -->" not in text:
        raise SystemExit(f"{readme}: no <!-- blt:parity --> block; add one to the BLT section")
    head, rest = text.split("<!-- blt:parity -->", 1)
    readme.write_text(head + block + rest.split("<!-- /blt:parity -->", 1)[1])
    print("\n".join(markdown(data)))
    print(f"wrote {OUT / 'blt_parity.json'} in {data['wall_s']} s")


if __name__ == "__main__":
    main()
