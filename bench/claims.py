"""The decision rule of bench/offpolicy.py's claims grid, as its docstring wrote it down before the grid ran
(2d055f2): paired differences by seed, a one-sided 95% t interval against 0 and DELTA, and the three claims
as the differences that must hold. `results` maps (variant, max_staleness) to runs, each a dict with "seed"
and "figure" (bench/offpolicy.py `load`)."""

DELTA = 0.05  # the smallest gap in the figure worth a claim: 3 test questions of 64
# one-sided 95% Student quantiles by degrees of freedom; past 10, the normal's
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}


def _t(n: int) -> float:
    return T95.get(n - 1, 1.645)


def beats(d: list[float]) -> tuple[str, str]:
    """The pre-written rule (the docstring) on one paired difference, "A's figure minus B's" per seed: the
    verdict, and what was seen (the mean, the interval and, when undecided, the seeds that would decide
    it)."""
    n = len(d)
    m = sum(d) / n
    sd = _sd(d)
    half = _t(n) * sd / n ** 0.5
    seen = f"{m:+.3f}, interval {m - half:+.3f} .. {m + half:+.3f} over {n} seeds"
    if m - half > 0:
        return "holds", seen
    if m + half < DELTA:
        return "does not hold", seen
    gap = max(m, DELTA - m)  # the distance to the bound m leans towards
    need = next((k for k in range(2, 1000) if _t(k) * sd / k ** 0.5 < gap), None)
    return "undecided", seen + (f"; about {need} seeds would decide it at this spread" if need else "")


def figures(results, name, eta) -> dict:
    return {r["seed"]: r["figure"] for r in results.get((name, eta), []) if r["figure"] is not None}


def _paired(a: dict, b: dict) -> list[float]:
    return [a[s] - b[s] for s in sorted(a.keys() & b.keys())]


def _drop(results, name) -> dict:
    at0, at8 = figures(results, name, 0), figures(results, name, 8)
    return {s: at0[s] - at8[s] for s in at0.keys() & at8.keys()}


# who, what they claim, and the paired differences that must all hold: (what, name, eta or "drop" , name)
CLAIMS = [("AReaL", "decoupled PPO stays stable under staleness where naive PPO degrades",
           [("decoupled PPO beats naive PPO at eta 8", "ppo", 8, "ppo_naive")]),
          ("Asynchronous RLHF", "online DPO is the most robust to off-policy data",
           [(f"online DPO drops less than {rival}", rival, "drop", "online_dpo")
            for rival in ("ppo", "grpo", "rloo")]),
          ("TBA", "trajectory balance with its replay stays robust far off-policy",
           [("TB drops less than grpo", "grpo", "drop", "tb"),
            ("TB drops less than TB without its replay", "tb_fifo", "drop", "tb")])]


def claims(results: dict) -> list[str]:
    """A verdict line per claim under the pre-written rule, and a line per comparison under it; a claim whose
    runs are missing from this grid is left out. Then each rule's drop from eta 0 to eta 8."""
    lines = []
    for who, what, parts in CLAIMS:
        found = []
        for text, a, how, b in parts:
            if how == "drop":
                d = _paired(_drop(results, a), _drop(results, b))
            else:
                d = _paired(figures(results, a, how), figures(results, b, how))
            if len(d) < 2:
                break
            found.append((text, *beats(d)))
        else:
            verdicts = [v for _, v, _ in found]
            verdict = "does not hold" if "does not hold" in verdicts else \
                "holds" if set(verdicts) == {"holds"} else "undecided"
            lines.append(f"{who}: {what}: {verdict}")
            lines += [f"    {text}: {v} ({seen})" for text, v, seen in found]
    names = sorted({name for name, eta in results if eta == 0 and (name, 8) in results})
    for name in names:
        drop = list(_drop(results, name).values())
        if len(drop) > 1:
            m, half = sum(drop) / len(drop), _t(len(drop)) * _sd(drop) / len(drop) ** 0.5
            lines.append(f"drop of {name}, eta 0 -> 8: {m:+.3f}, interval {m - half:+.3f} .. {m + half:+.3f}")
    return lines


def _sd(values):
    m = sum(values) / len(values)
    return (sum((x - m) ** 2 for x in values) / (len(values) - 1)) ** 0.5
