"""Case strategies (hypothesis) and the dev/quick/ci/release profiles. Public and validated."""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from verify.case import Case
from verify.opdef import OpDef
from verify.values import EDGE_DISTS

CONFIG_ORDER = ("tiny", "small", "k3")      # shrink toward the smallest config


def _draw_without_local_constants() -> None:
    """A seed must draw the same cases in every process: `run --shards` deals from the parent's dry
    draw, the op's own child and `--resume` draw again, and a certificate's cases are reproducible
    from its seed. Hypothesis (6.131+) mixes integer and float constants found in the source of every
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


@dataclass(frozen=True)
class Profile:
    name: str
    examples: int            # hypothesis examples per op and candidate
    configs: tuple[str, ...]
    max_batch: int
    all_dtypes: bool         # False: the op's first (working) dtype only
    shrink: bool
    tp_sweep: bool           # one explicit case per T in the op's tp_values
    dtypes: tuple[str, ...] | None = None   # restrict working dtypes (None: as all_dtypes says)
    sweep_tps: tuple[int, ...] | None = None  # T values of the sweep (None: all the op declares)
    compile_heavy: bool = True               # also run torch.compile on ops marked compile_heavy
    strided_run: bool = True                 # the strided/offset-views guard run (a recompile for inductor)
    dist_sweep: bool = True                  # one explicit case per op dist the hypothesis draw missed
    knob_sweep: bool = True                  # the op's knob_sweep cases (knob_sweep_cases)
    batch_sweep: bool = True                 # the dispatch-boundary batch sizes (batch_sweep_cases)


PROFILES = {
    # quick: the default job; must finish in minutes on a 2-core CPU with the compiled candidate. The
    # working dtype only; a failure is shrunk (it costs only when a pair fails).
    "quick": Profile("quick", 4, ("tiny", "small"), 16, False, True, True, sweep_tps=(4,), compile_heavy=False,
                     strided_run=False, dist_sweep=False, batch_sweep=False),
    "ci": Profile("ci", 25, ("tiny", "small"), 64, True, True, True),
    "release": Profile("release", 200, ("tiny", "small", "k3"), 64, True, True, True),
}


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"--profile {name!r} is unknown; choose one of {', '.join(PROFILES)}")
    return PROFILES[name]


def validate_tp(tps: list[int] | None) -> list[int] | None:
    if tps is None:
        return None
    for t in tps:
        if t not in (1, 2, 4, 8, 16):
            raise ValueError(f"--tp {t}: tensor-parallel degree must be one of 1, 2, 4, 8, 16")
    return tps


def op_tps(op: OpDef, tps: list[int] | None) -> list[int]:
    if op.split is None:
        return [1]
    allowed = [t for t in op.split.tp_values if tps is None or t in tps]
    return allowed or [1]


def drawn_dtypes(op: OpDef, profile: Profile) -> list[str]:
    """The working dtypes this profile draws for the op."""
    dtypes = list(op.dtypes) if profile.all_dtypes else [op.dtypes[0]]
    if profile.dtypes is not None:
        dtypes = [d for d in op.dtypes if d in profile.dtypes] or [op.dtypes[0]]
    return dtypes


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


def dist_sweep_cases(op: OpDef, profile: Profile, seed: int, drawn: set[str]) -> list[Case]:
    """One explicit case per dist of the op that the hypothesis draw did not reach (`drawn`: the dists of
    its non-vacuous cases). The draw picks the dist with sampled_from, about uniformly over op.dists, so
    a run of n examples misses a given one of d dists with probability ~(1 - 1/d)^n: ~5% for 6 dists at
    25 examples (measured 10 of 200 hypothesis seeds), and the seed per op is fixed, so an op can miss
    one for good (kda_decode's 25-example draw at seed 0 never drew small_rows). Unsplit (T = 1), the
    first config, B = min(8, max_batch) rows (several per-row regimes of zero_rows / small_rows), the
    working dtypes taken in turn. The edge dists (values.EDGE_DISTS) get their case whether drawn or
    not: their specials sit in some rows and some inputs only, and a drawn case can hold none that
    matters (one row, a layout with one source: a planted NaN-skipping AttnRes mix was certified while
    its only nonfinite draws were such cases)."""
    if not profile.dist_sweep:
        return []
    drawn = set(drawn) - set(EDGE_DISTS)
    config = next((c for c in CONFIG_ORDER if c in op.configs and c in profile.configs), op.configs[0])
    batch = max(1, min(8, op.max_batch, profile.max_batch))
    dtypes = drawn_dtypes(op, profile)
    return [Case(op.name, seed + DIST_SWEEP_SEED + i, batch, config, dtypes[i % len(dtypes)], dist, 1)
            for i, dist in enumerate(op.dists) if dist not in drawn]
