"""From a plan and its judged cases to a certificate: the one path a run, a resumed run, a `--jobs`
run and `verify-kernels merge DIR...` (shards judged anywhere, by any scheduler) all take, so their
certificates agree case for case."""
from __future__ import annotations

from pathlib import Path

from verify.model.verdict import OpVerdict
from verify.ops.registry import all_ops
from verify.plan.plan import PLAN_NAME, Plan, load
from verify.record import certificate
from verify.run.execute import judged_in, logs_in
from verify.run.runlog import LOG_NAME, case_record
from verify.run.runner import Judged, summarise


class MergeError(ValueError):
    """Shard outputs that cannot be joined: one line saying why."""


def assemble(plan: Plan, judged: Judged, carried: dict | None = None,
             extra_options: dict | None = None) -> tuple[list[OpVerdict], dict]:
    """(op verdicts, certificate) of a plan from its judged cases."""
    device = plan.options.get("device", "cpu")
    verdicts = summarise(plan, judged, device)
    cases = {(p.op, p.candidate): [case_record(judged.verdicts[i]) for i in p.cases if i in judged.verdicts]
             for p in plan.pairs}
    options = dict(plan.options, plan=plan.id, **(extra_options or {}))
    return verdicts, certificate.build(verdicts, all_ops(), options, device, cases, carried)


def load_shards(dirs: list[Path], partial: bool = False) -> tuple[Plan, Judged]:
    """The one plan the directories share and every verdict their logs hold; a MergeError when a
    directory has no plan or log, the plans differ, or (unless `partial`) some planned case has no
    verdict. With `partial` (a run cut at a time limit) the pairs with unjudged cases fail as
    incomplete in the certificate (runner.summarise) and every other pair gets its verdict."""
    plans = []
    for d in dirs:
        if not (Path(d) / PLAN_NAME).is_file() or not logs_in(Path(d)):
            raise MergeError(f"{d}: no {PLAN_NAME} and {LOG_NAME} here (not a `verify-kernels run` output directory)")
        try:
            plans.append(load(Path(d) / PLAN_NAME))
        except ValueError as e:
            raise MergeError(str(e)) from None
    ids = {p.id for p in plans}
    if len(ids) > 1:
        where = ", ".join(f"{d}: {p.id}" for d, p in zip(dirs, plans))
        raise MergeError(f"the outputs are of different plans ({where}); merge shards of one plan only")
    plan = plans[0]
    try:
        judged = judged_in(dirs, plan.id)
    except ValueError as e:
        raise MergeError(str(e)) from None
    missing = [pc.index for pc in plan.cases if pc.index not in judged.verdicts]
    if missing and not partial:
        raise MergeError(f"{len(missing)} of {len(plan.cases)} planned cases have no verdict in these outputs "
                         f"(first: #{missing[0]}); merge every shard, finish one with run --resume, or certify "
                         "the ops judged in full with --partial")
    return plan, judged
