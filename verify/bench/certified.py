"""Speed only for candidates that compute the op: which (op, candidate) pairs hold a passing verdict.

With certificates (`--certificate`), the release gate's rule (verify.record.gate): the newest verdict whose
sources match this tree, passed or failed only as its spec waives. Without, the quick profile is
certified here first, in this process, through the harness's own `certify_op`, and its certificate is
written beside bench.json. A candidate that cannot run here at all (no fused kernel for the op) is
left out, not refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field

OK_STATUSES = ("pass", "waived")


@dataclass
class Gate:
    allowed: dict[str, dict[str, object]] = field(default_factory=dict)   # op -> label -> fn
    applies: dict[str, list[str]] = field(default_factory=dict)          # op -> labels asked that apply
    refused: list[dict] = field(default_factory=list)                    # {op, candidate, state, reason}
    absent: list[dict] = field(default_factory=list)                     # {op, candidate, reason}: cannot run here
    certificate: str | None = None                                        # where the verdicts come from

    def certified_ops(self) -> dict[str, set]:
        out: dict[str, set] = {}
        for op, labels in self.allowed.items():
            for label in labels:
                out.setdefault(label, set()).add(op)
        return out


def _resolve(op, label: str, device: str):
    """The candidate's function, or (None, reason) when it cannot run here."""
    from verify.judge.candidates import Candidate, CandidateImportError, CandidateUnavailable

    try:
        return Candidate(label).resolve(op, device), ""
    except CandidateUnavailable as e:
        return None, str(e)
    except CandidateImportError as e:
        return None, f"cannot import: {e}"


def from_certificates(ops, labels: list[str], paths: list[str], device: str) -> Gate:
    from verify.record import certificate
    from verify.record import gate

    certs = [(p, certificate.load(p)) for p in paths]
    out = Gate(certificate=",".join(paths))
    for op in ops:
        for label in labels:
            fn, why = _resolve(op, label, device)
            if fn is None:
                out.absent.append({"op": op.name, "candidate": label, "reason": why})
                continue
            out.applies.setdefault(op.name, []).append(label)
            st = gate.op_state(op, certs, label)
            if st.ok:
                out.allowed.setdefault(op.name, {})[label] = fn
            else:
                out.refused.append({"op": op.name, "candidate": label, "state": st.state, "reason": st.detail})
    return out


def by_quick_certification(ops, labels: list[str], device: str, out_dir, log=print) -> Gate:
    """Certify every (op, candidate) with the quick profile, write OUT/certificate.json, gate on it."""
    from pathlib import Path

    from verify.record import certificate
    from verify.judge.candidates import Candidate
    from verify.model.profile import get_profile
    from verify.run.runner import RunOptions, certify_op
    from verify.ops.registry import all_ops

    profile = get_profile("quick")
    opts = RunOptions(device=device, profile=profile, seed=0)
    out, verdicts = Gate(), []
    for op in ops:
        for label in labels:
            fn, why = _resolve(op, label, device)
            if fn is None:
                out.absent.append({"op": op.name, "candidate": label, "reason": why})
                continue
            out.applies.setdefault(op.name, []).append(label)
            log(f"certifying {op.name} / {label} (quick profile)")
            try:
                v = certify_op(op, Candidate(label), opts)
            except Exception as e:  # noqa: BLE001  (the harness itself failed: no verdict, so no speed)
                out.refused.append({"op": op.name, "candidate": label, "state": "error",
                                    "reason": f"certification raised {type(e).__name__}: {e}"[:300]})
                continue
            verdicts.append(v)
            if v.status in OK_STATUSES:
                out.allowed.setdefault(op.name, {})[label] = fn
            else:
                out.refused.append({"op": op.name, "candidate": label, "state": v.status,
                                    "reason": v.reason or "not certified"})
    if verdicts:
        options = {"profile": profile.name, "configs": list(profile.configs), "dtypes": None, "seed": 0,
                   "examples": None, "tp": None, "device": device, "candidates": labels,
                   "ops": [o.name for o in ops], "isolated": False, "by": "verify-kernels bench",
                   "harness": certificate.harness_hash()}
        path = certificate.write(certificate.build(verdicts, all_ops(), options, device), Path(out_dir))
        out.certificate = str(path)
    return out
