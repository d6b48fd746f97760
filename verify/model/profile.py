"""Profiles (quick, ci, release): how many cases a run draws per op and candidate, over which configs,
batches and dtypes, and which guard runs and sweeps it includes. Validated helpers for the run options."""
from __future__ import annotations

from dataclasses import dataclass

from verify.model.opdef import OpDef

CONFIG_ORDER = ("tiny", "small", "k3")      # shrink toward the smallest config


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
