"""Which certificate still holds for this tree: the release gate's question.

    verify-kernels check CERT.json [CERT.json ...] [--ops ...] [--candidate fused] [--profile release]

A verdict holds when the sources it was judged on (reference, fused kernel, spec, registry entry,
harness: `certificate.op_sources`; and for a candidate named by import path, its own module and the
modules it imports: `certificate.candidate_sources`) equal the tree's now. For each op, the newest certificate whose
entry holds gives the op's state; an op passes the gate only when that verdict passed (or failed
exactly as its spec waives). Anything else names what to do: a stale op names the sources that
changed since its newest verdict and the files behind them (from the certificate's per-file hashes,
or from git since the commit it names), a missing one says no certificate judged it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

OK_STATUSES = ("pass", "waived")


@dataclass(frozen=True)
class OpState:
    op: str
    state: str                 # certified | failed | not_certified | partial_scope | stale | missing
    certificate: str = ""      # the file whose verdict holds (or the newest one seen, when stale)
    created: str = ""
    git_commit: str = ""
    profile: str = ""
    device: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.state == "certified"


def _entries(certs: list[tuple[str, dict]], op: str, candidate: str):
    """(path, cert, entry, verdict) for every certificate that judged op/candidate, newest first."""
    found = []
    for path, cert in certs:
        entry = cert.get("ops", {}).get(op)
        verdict = (entry or {}).get("verdicts", {}).get(candidate)
        if verdict is not None:
            found.append((path, cert, entry, verdict))
    return sorted(found, key=lambda f: f[1].get("created") or "", reverse=True)


def op_state(op, certs: list[tuple[str, dict]], candidate: str, profile: str | None = None,
             device: str | None = None, full_scope: bool = False) -> OpState:
    from verify.record.certificate import candidate_holds, candidate_sources, op_sources

    found = [f for f in _entries(certs, op.name, candidate)
             if (profile is None or f[1].get("options", {}).get("profile") == profile)
             and (device is None or f[1].get("environment", {}).get("device") == device)]
    if not found:
        need = " ".join(x for x in (f"profile {profile}" if profile else "", f"on {device}" if device else "") if x)
        return OpState(op.name, "missing", detail=f"no certificate judged {candidate}" + (f" ({need})" if need else ""))
    now, own = op_sources(op), candidate_sources(candidate)
    for path, cert, entry, verdict in found:
        if entry.get("sources") == now and not candidate_holds(entry, candidate, own):
            status = verdict.get("status")
            if status in OK_STATUSES and full_scope and verdict.get("scope"):
                return _state(op.name, "partial_scope", path, cert,
                              f"certified only in its declared scope ({'; '.join(verdict['scope'])}); "
                              "the whole contract is demanded here (--full-scope, or --profile release)")
            if status in OK_STATUSES:
                return _state(op.name, "certified", path, cert, verdict.get("reason", ""))
            if status == "skip":
                return _state(op.name, "not_certified", path, cert, f"skipped: {verdict.get('reason', '')}")
            return _state(op.name, "failed", path, cert, verdict.get("reason", ""))
    path, cert, entry, _ = found[0]
    why = ", ".join(w for w in (_what_changed(op, cert, entry, now) if entry.get("sources") != now else "",
                                candidate_holds(entry, candidate, own)) if w)
    return _state(op.name, "stale", path, cert, "changed since its newest verdict: " + why + "; run it again")


def _what_changed(op, cert: dict, entry: dict, now: dict) -> str:
    """The source groups that changed since a stale verdict and the files behind them: from the
    certificate's per-file hashes, else from git since the commit it names."""
    from verify.record.certificate import changed_files_since, source_change, source_files

    old_files = entry.get("source_files")
    text = source_change(entry.get("sources") or {}, now, old_files,
                         source_files(op) if old_files is not None else None)
    if old_files is not None:
        return text
    commit = (cert.get("environment") or {}).get("git_commit")
    files = changed_files_since(commit, op)
    return text + (f" (per git since {commit[:12]}: {', '.join(files)})" if files else "")


def _state(op: str, state: str, path: str, cert: dict, detail: str) -> OpState:
    """An OpState naming the certificate it comes from: when, which commit, profile and device."""
    env, opts = cert.get("environment", {}), cert.get("options", {})
    return OpState(op, state, certificate=path, created=cert.get("created", ""),
                   git_commit=(env.get("git_commit") or "")[:12], profile=opts.get("profile", ""),
                   device=env.get("device", ""), detail=detail)


def check(ops, certs: list[tuple[str, dict]], candidate: str, profile: str | None = None,
          device: str | None = None, full_scope: bool = False) -> list[OpState]:
    """full_scope: a verdict certified only in a candidate's declared scope (DTYPES, PARAMS) does not
    count (the release gate demands the whole contract)."""
    return [op_state(op, certs, candidate, profile, device, full_scope) for op in ops]


def to_dict(states: list[OpState]) -> dict:
    return {"ok": all(s.ok for s in states), "ops": [dict(asdict(s), ok=s.ok) for s in states]}
