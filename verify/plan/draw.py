"""Case strategies (hypothesis) and the explicit sweeps: what cases a plan lists for one op."""
from __future__ import annotations

from hypothesis import strategies as st

from verify.model.case import Case
from verify.model.opdef import OpDef
from verify.model.profile import CONFIG_ORDER, Profile, drawn_dtypes, op_tps
from verify.model.values import EDGE_DISTS


def _draw_without_local_constants() -> None:
    """A seed must draw the same plan in every process: a shard, a resumed run and a merge each
    plan again and must agree, and a certificate's cases are reproducible from its seed. Hypothesis (6.131+) mixes integer and float constants found in the source of every
    imported non-site-packages module into its draws, so the draw depended on what the process had
    imported (on the device, the CuTe DSL bundle is unpacked outside site-packages). Its global
    constants stay; the local pool is kept empty. Checked by
    property_tests/test_cli_shards.py::test_the_draw_does_not_depend_on_the_modules_imported."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:              # a hypothesis without the local pool
        return
    if hasattr(providers, "_get_local_constants"):
        empty = Constants()
        providers._get_local_constants = lambda: empty


_draw_without_local_constants()


def case_strategy(op: OpDef, profile: Profile, tps: list[int] | None = None, device: str = "cpu"):
    """Cases for one op. Shrinks toward seed 0, batch 1, the smallest config, the first dtype, T=1."""
    configs = [c for c in CONFIG_ORDER if c in op.configs and c in profile.configs] or [op.configs[0]]
    dtypes = drawn_dtypes(op, profile)
    tp_choices = sorted(set([1] + op_tps(op, tps)))
    return st.builds(
        Case,
        op=st.just(op.name),
        seed=st.integers(0, 2**31 - 1),
        batch=st.integers(1, max(1, min(op.max_batch, profile.max_batch))),
        config=st.sampled_from(configs),
        dtype=st.sampled_from(dtypes),
        dist=st.sampled_from(list(op.dists)),
        # Half the cases unsplit: the guard runs (determinism, batch position, strides) need T=1.
        tp=st.one_of(st.just(1), st.sampled_from(tp_choices)) if len(tp_choices) > 1 else st.just(1),
    )


def tp_sweep_cases(op: OpDef, profile: Profile, seed: int, tps: list[int] | None) -> list[Case]:
    """One explicit case per T so every declared split is exercised in every profile."""
    if op.split is None or not profile.tp_sweep:
        return []
    config = next((c for c in CONFIG_ORDER if c in op.configs and c in profile.configs), op.configs[0])
    batch = min(5, op.max_batch)
    dist = "order_sensitive" if op.split.order_sensitive and "order_sensitive" in op.dists else op.dists[0]
    sweep = [t for t in op_tps(op, tps) if t > 1 and (profile.sweep_tps is None or t in profile.sweep_tps)]
    dtype = drawn_dtypes(op, profile)[0]
    return [Case(op.name, seed + t, batch, config, dtype, dist, t) for t in sweep]


DIST_SWEEP_SEED = 100       # dist sweep seeds: seed + 100 + index in op.dists (the T sweep takes seed + T)
KNOB_SWEEP_SEED = 200       # knob sweep seeds: seed + 200 + 10 x knob set + case index
BATCH_SWEEP_SEED = 400      # batch sweep seeds: seed + 400 + batch


def sweep_batches(max_batch: int) -> list[int]:
    """The batch sizes where a kernel's dispatch on M most often changes: 1, 2, 3, every power of two
    and the one above it, the midpoints 3p/2 between powers of two (6, 12, 24, 48: tuned buckets end
    there too, e.g. an M tile of 16 up to 24 then 32), and the largest two (max_batch - 1, max_batch),
    up to max_batch."""
    out = {1, 2, 3, max_batch - 1, max_batch}
    p = 4
    while p <= max_batch:
        out |= {p, p + 1, p + p // 2}
        p *= 2
    return sorted(b for b in out if 1 <= b <= max_batch)


def batch_sweep_cases(op: OpDef, profile: Profile, seed: int) -> list[Case]:
    """One explicit unsplit case per batch of `sweep_batches` (in every profile but quick): a kernel with
    a variant per M range (a tile of 32 rows for M in 17..32, a fast path at M = 64) is wrong only at
    the M it mishandles, and a run's drawn batches are few and random (a 25-example ci draw reached
    no M in 25..32 and no M = 64 for skinny_gemm at seed 0: an M-tile bug there was certified). The
    profile's largest config (at release: the K3 shapes, where the dispatch sits), its working dtype,
    the op's first dist."""
    if not profile.batch_sweep:
        return []
    configs = [c for c in CONFIG_ORDER if c in op.configs and c in profile.configs] or [op.configs[0]]
    dtype = drawn_dtypes(op, profile)[0]
    return [Case(op.name, seed + BATCH_SWEEP_SEED + b, b, configs[-1], dtype, op.dists[0], 1)
            for b in sweep_batches(max(1, min(op.max_batch, profile.max_batch)))]


def knob_sweep_cases(op: OpDef, profile: Profile, seed: int, tps: list[int] | None) -> list[Case]:
    """Explicit cases for each of the op's `knob_sweep` knob sets (shapes the hypothesis draw does not
    reach, e.g. skinny_gemm's off-tile projection, whose N and K are odd multiples of 16): one unsplit
    case per config of the profile, B = min(5, max_batch) (an odd batch), the working dtype, the op's
    first dist, and one case split at the op's largest T in the profile (its shards off-tile too); then
    one unsplit case per other drawn dtype at the first config (a range edge, such as fp16's
    subnormals and overflow, lives in one dtype)."""
    if not op.knob_sweep or not profile.knob_sweep:
        return []
    configs = [c for c in CONFIG_ORDER if c in op.configs and c in profile.configs] or [op.configs[0]]
    batch = min(5, op.max_batch)
    dtypes = drawn_dtypes(op, profile)
    split = [t for t in op_tps(op, tps) if t > 1 and (profile.sweep_tps is None or t in profile.sweep_tps)]
    out = []
    for i, knobs in enumerate(op.knob_sweep):
        extra = tuple(sorted(knobs.items()))
        runs = ([(config, dtypes[0], 1) for config in configs] + ([(configs[0], dtypes[0], max(split))] if split else [])
                + [(configs[0], d, 1) for d in dtypes[1:]])
        out += [Case(op.name, seed + KNOB_SWEEP_SEED + 10 * i + j, batch, config, dtype, op.dists[0], t, extra)
                for j, (config, dtype, t) in enumerate(runs)]
    return out


def dist_sweep_cases(op: OpDef, profile: Profile, seed: int) -> list[Case]:
    """One explicit case per dist of the op, whatever the draw reached. The draw picks the dist with
    sampled_from, so a run of n examples misses a given one of d dists with probability
    ~(1 - 1/d)^n (~5% for 6 dists at 25 examples), and a dist drawn only in vacuous cases, or one whose
    specials (values.EDGE_DISTS: NaN, inf, range edges in some rows) sit where they do not matter,
    would go unjudged. Unsplit (T = 1), the first config, B = min(8, max_batch) rows (several per-row
    regimes of zero_rows / small_rows), the working dtypes taken in turn."""
    if not profile.dist_sweep:
        return []
    config = next((c for c in CONFIG_ORDER if c in op.configs and c in profile.configs), op.configs[0])
    batch = max(1, min(8, op.max_batch, profile.max_batch))
    dtypes = drawn_dtypes(op, profile)
    return [Case(op.name, seed + DIST_SWEEP_SEED + i, batch, config, dtypes[i % len(dtypes)], dist, 1)
            for i, dist in enumerate(op.dists)]


def drawn_cases(op: OpDef, profile: Profile, seed: int, tps: list[int] | None = None,
                examples: int | None = None) -> list[Case]:
    """The hypothesis draw of `examples` (default: the profile's) cases for one op, in draw order,
    without repeats. Deterministic for (op, profile, seed, tps): nothing is judged while drawing."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed

    out: dict[str, Case] = {}

    @settings(max_examples=examples or profile.examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(case_strategy(op, profile, tps))
    def collect(case: Case):
        out.setdefault(case.to_json(), case)

    hyp_seed(seed + sum(map(ord, op.name)))(collect)()
    return list(out.values())


def planned_cases(op: OpDef, profile: Profile, seed: int, tps: list[int] | None = None,
                  examples: int | None = None) -> list[Case]:
    """Every case a run lists for one op: the draw, then the T, dist, knob and batch sweeps; each
    case once, in that order."""
    cases = (drawn_cases(op, profile, seed, tps, examples) + tp_sweep_cases(op, profile, seed, tps)
             + dist_sweep_cases(op, profile, seed) + knob_sweep_cases(op, profile, seed, tps)
             + batch_sweep_cases(op, profile, seed))
    return list({c.to_json(): c for c in cases}.values())
