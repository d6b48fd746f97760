"""The speed rule per row and the score per candidate.

Rule (decidable in one run): at every shape timed, the candidate is faster (median) than the
reference eager, torch.compile of it and every declared peer, and takes <= 1.25 x the floor where
the floor is 10 us or more, <= 2 x below (latency-bound sizes, where a launch costs about a
microsecond). A row misses with its reasons; a baseline that could not be timed leaves its
comparison unjudged ("incomplete" unless something else missed).

Score: per candidate, the share of benchmarked shapes where it is certified and at least p times
faster than the eager reference (p = 1, 1.5, 2), and the same against the best (fastest) peer over
the shapes where a peer was timed.
"""
from __future__ import annotations

FLOOR_SPLIT_US = 10.0
FLOOR_LIMITS = (1.25, 2.0)          # at or above the split, below it
PS = (1.0, 1.5, 2.0)
MET, MISS, INCOMPLETE = "met", "miss", "incomplete"


def floor_limit(floor_us: float) -> float:
    return FLOOR_LIMITS[0] if floor_us >= FLOOR_SPLIT_US else FLOOR_LIMITS[1]


def judge(us: float, baselines: dict[str, float | None], floor_us: float | None) -> dict:
    """One candidate's row: `baselines` maps eager / compiled / peer:NAME to its median (None: not
    timed). Returns verdict, misses, unjudged, the floor ratio and its limit."""
    misses, unjudged = [], []
    for name, b in baselines.items():
        if b is None:
            unjudged.append(name)
        elif not us < b:
            misses.append(f"not faster than {name} ({us:.2f} vs {b:.2f} us, {us / b:.2f}x)")
    ratio = limit = None
    if floor_us is None or floor_us <= 0:
        unjudged.append("floor")
    else:
        ratio, limit = us / floor_us, floor_limit(floor_us)
        if ratio > limit:
            misses.append(f"{ratio:.2f}x the floor ({floor_us:.2f} us; limit {limit}x)")
    verdict = MISS if misses else INCOMPLETE if unjudged else MET
    return {"verdict": verdict, "misses": misses, "unjudged": unjudged,
            "floor_ratio": None if ratio is None else round(ratio, 4), "floor_limit": limit}


def speedups(us: float, others: dict[str, float | None]) -> dict[str, float]:
    """How many times faster than each other timed entry (other / us; > 1 is faster)."""
    return {name: round(o / us, 4) for name, o in others.items() if o is not None and us > 0}


def summary(rows: list[dict], candidates: list[str], certified: dict[str, set]) -> dict[str, dict]:
    """Per candidate over every benchmarked row of an op it applies to. rows: bench.json rows;
    certified: candidate -> ops where it holds a passing verdict."""
    out = {}
    for cand in candidates:
        mine = [r for r in rows if cand in r.get("candidates", [])]
        n = len(mine)
        ok_rows = [r for r in mine if r["op"] in certified.get(cand, set())
                   and r["timings"].get(cand, {}).get("median_us") is not None]
        vs_eager, vs_peer, peer_rows, met = {}, {}, 0, 0
        for p in PS:
            vs_eager[str(p)] = 0
            vs_peer[str(p)] = 0
        for r in mine:
            best = best_peer(r)
            peer_rows += best is not None
        for r in ok_rows:
            us = r["timings"][cand]["median_us"]
            eager = (r["timings"].get("eager") or {}).get("median_us")
            best = best_peer(r)
            met += r["judged"].get(cand, {}).get("verdict") == MET
            for p in PS:
                vs_eager[str(p)] += eager is not None and eager / us >= p
                vs_peer[str(p)] += best is not None and best[1] / us >= p
        out[cand] = {"shapes": n, "certified_and_timed": len(ok_rows), "rule_met": met,
                     "vs_eager": {p: _share(k, n) for p, k in vs_eager.items()},
                     "peer_shapes": peer_rows,
                     "vs_best_peer": {p: _share(k, peer_rows) for p, k in vs_peer.items()}}
    return out


def best_peer(row: dict) -> tuple[str, float] | None:
    """(name, median) of the fastest timed peer of a row, or None."""
    peers = [(k, v["median_us"]) for k, v in row["timings"].items()
             if k.startswith("peer:") and v and v.get("median_us") is not None]
    return min(peers, key=lambda kv: kv[1]) if peers else None


def _share(k: int, n: int) -> float | None:
    return None if n == 0 else round(k / n, 4)
