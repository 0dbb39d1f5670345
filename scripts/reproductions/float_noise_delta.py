"""How much δ the old float32 Gaussian noise lost, and what float64 noise loses.

torch's CPU normal sampler is Box–Muller on uniforms with a ``b``-bit grid (b = 24 for float32,
53 for float64): u1 = 1 - k 2^-b (k < 2^b), u2 = l 2^-b, z = sqrt(-2 ln u1) (cos 2πu2, sin 2πu2).
So |z| <= M_b = sqrt(2 b ln 2) (5.768 for float32) and the tail near M_b is a few grid points.

A canary whose clipped vector (norm C) is spread over d coordinates shifts each coordinate of the
noisy sum by μ = C/√d, i.e. by μ/σ = 1/(z √d) noise standard deviations. An output coordinate
above M_b σ (plus the others' sum) is impossible without the canary, so the tail event
E = {some coordinate's noise > M_b - 1/(z√d)} gives, for any ε, δ >= P[E | canary] · q per
release, and over T releases (fresh noise each) δ_run >= 1 - (1 - q P[E])^T. Spreading the
canary evenly maximises this (the per-coordinate probability grows like sqrt(shift)). This
is a *lower bound* on the extra δ (the discreteness elsewhere is ignored); the total is at
least max(δ_accountant, δ_tail) and about their sum.

P[E] is computed exactly on the grid: for each radius k = 1, 2, ... above the threshold, the
number of u2 grid points whose cos (or sin) exceeds threshold / radius.

    # DATA: the folder holding mnist/ and fashion_mnist/ IDX files (or set FEDUDP_DATA instead)
    .venv/bin/python scripts/reproductions/float_noise_delta.py --data-root DATA --out docs/results/privacy_audit
"""

from __future__ import annotations

import argparse
import os
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def max_radius(bits: int) -> float:
    return math.sqrt(2 * bits * math.log(2))


def coordinate_tail(bits: int, shift: float) -> float:
    """P[one output coordinate of torch's ``bits``-grid Box–Muller exceeds M_b - shift]."""
    thr, p = max_radius(bits) - shift, 0.0
    k = 1
    while True:
        r = math.sqrt(-2 * math.log(k * 2.0**-bits))  # u1 = k 2^-b
        if r <= thr:
            return p
        # u2 on the grid with cos(2π u2) > thr / r: |angle| < a, i.e. 2 floor(a/(2π) 2^b) + 1 points
        a = math.acos(thr / r)
        p += 2.0**-bits * (2 * math.floor(a / (2 * math.pi) * 2.0**bits) + 1) * 2.0**-bits
        k += 1


def run_delta(bits: int, z: float, d: int, q: float, releases: int) -> float:
    """Lower bound on the whole run's δ from the tail event alone (see the module doc)."""
    p1 = coordinate_tail(bits, 1.0 / (z * math.sqrt(d)))
    per_release = q * -math.expm1(d * math.log1p(-p1))
    return -math.expm1(releases * math.log1p(-per_release))


def settings(data_root: str):
    """(name, z, d, q, releases, ε, δ) of the three settings (``data_root``: the MNIST IDX
    folder the Huang Table 1 preset reads)."""
    import dp_accounting
    from fedudp.aggregators.gaussian import gaussian_round_event
    from fedudp.models.cnn import PaperCNN
    from fedudp.privacy.accountant import calibrate_noise_multiplier
    from reproduce_huang import compose

    d_cnn = sum(p.numel() for p in PaperCNN(1, 10, 28).parameters())
    out = []
    cfg = compose(
        {"partition.num_owners": 16, "method": "full_dp", "privacy.placement": "server"},
        data_root,
        1,
    )
    from fedudp.run import prepare

    agg = prepare(cfg).aggregator
    out.append(
        (
            "huang_table1, full_dp, privacy.placement=server, n=16",
            agg.noise_multiplier,
            d_cnn,
            agg.sampling.rate,
            cfg.train.rounds,
            cfg.privacy.epsilon,
            cfg.privacy.delta,
        )
    )
    for q, T in ((0.01, 1000), (0.05, 400)):
        eps, delta = 1.0, 1e-5
        z = calibrate_noise_multiplier(lambda s: gaussian_round_event(s, q), eps, delta, T)
        out.append((f"full_dp, CNN, q={q}, T={T}", z, d_cnn, q, T, eps, delta))
    del dp_accounting
    return out


def sampler_check(n: int = 50_000_000) -> tuple[float, float]:
    """(largest |z| torch's float32 sampler gave in n draws, M_24)."""
    g = torch.Generator().manual_seed(0)
    top = 0.0
    for _ in range(n // 10_000_000):
        top = max(top, float(torch.randn(10_000_000, generator=g).abs().max()))
    return top, max_radius(24)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding the IDX files (<root>/mnist/, <root>/fashion_mnist/); default: $FEDUDP_DATA",
    )
    a = ap.parse_args()
    if not a.data_root:
        raise SystemExit(
            "float_noise_delta.py: error: --data-root <folder with the MNIST IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    sys.path.insert(0, str(ROOT / "scripts" / "reproductions"))
    t0 = time.time()
    top, m24 = sampler_check()
    rows = []
    for name, z, d, q, T, eps, delta in settings(a.data_root):
        d32, d64 = run_delta(24, z, d, q, T), run_delta(53, z, d, q, T)
        rows.append(
            f"| {name} | {z:.3f} | {d:,} | {q:g} | {T} | {eps:g} | {delta:g} | "
            f"{d32:.3g} | {d32 / delta:.2f}× | {(delta + d32) / delta:.2f}× | {d64:.3g} |"
        )
    text = (
        "| setting | z | d | q | releases | ε | δ (accountant) | float32: δ from the tail alone "
        "| tail / δ | ≈ total / δ | float64 (now): δ from the tail |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        f"torch float32 sampler check: largest |z| in 50,000,000 draws = {top:.4f} "
        f"<= M_24 = {m24:.4f}; float64: M_53 = {max_radius(53):.4f}.\n"
        f"Wall time {time.time() - t0:.0f} s.\n"
    )
    print(text)
    if a.out:
        Path(a.out, "float32_noise_delta.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
