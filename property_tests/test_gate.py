"""`verify-kernels check`: which certificate still holds for the tree. A verdict holds only while
every source it was judged on is unchanged; the newest holding verdict decides; a stale, failed,
skipped or missing op fails the gate with what to do."""
import json

import pytest

from verify import gate
from verify.certificate import op_sources
from verify.cli import main
from verify.registry import get_op

OPS = [get_op("skinny_gemm"), get_op("router_topk")]


def _cert(created, status="pass", profile="release", device="cuda", sources=None, ops=("skinny_gemm", "router_topk"),
          candidate="fused"):
    return {"format": "verify-kernels/certificate/v1", "created": created,
            "environment": {"device": device, "git_commit": "abc1234def"}, "options": {"profile": profile},
            "ops": {name: {"sources": sources(name) if sources else op_sources(get_op(name)),
                           "verdicts": {candidate: {"status": status, "reason": f"{status} reason"}}}
                    for name in ops}}


def _stale(field):
    def sources(name):
        s = dict(op_sources(get_op(name)))
        s[field] = "0" * 64
        return s
    return sources


def test_the_newest_holding_verdict_decides():
    old_pass = ("a.json", _cert("2026-11-29T00:00:00+00:00"))
    new_fail = ("b.json", _cert("2026-11-30T00:00:00+00:00", status="fail"))
    newer_stale = ("c.json", _cert("2026-12-01T00:00:00+00:00", sources=_stale("fused")))
    states = gate.check(OPS, [old_pass, newer_stale, new_fail], "fused")
    assert [(s.state, s.certificate) for s in states] == [("failed", "b.json")] * 2
    states = gate.check(OPS, [old_pass, newer_stale], "fused")
    assert [(s.state, s.certificate, s.ok) for s in states] == [("certified", "a.json", True)] * 2


@pytest.mark.parametrize("field", ["fused", "reference", "spec", "registry", "harness"])
def test_a_changed_source_makes_the_op_stale_and_names_it(field):
    (st, _) = gate.check(OPS, [("a.json", _cert("2026-11-30T00:00:00+00:00", sources=_stale(field)))], "fused")
    assert st.state == "stale" and not st.ok
    assert f"changed since its newest verdict: {field};" in st.detail


def test_skipped_missing_and_waived():
    states = gate.check(OPS, [("a.json", _cert("2026-11-30T00:00:00+00:00", status="skip", ops=("skinny_gemm",)))],
                        "fused")
    assert [s.state for s in states] == ["not_certified", "missing"]
    assert "no certificate judged fused" in states[1].detail
    (st, _) = gate.check(OPS, [("a.json", _cert("2026-11-30T00:00:00+00:00", status="waived"))], "fused")
    assert st.ok
    (st, _) = gate.check(OPS, [("a.json", _cert("2026-11-30T00:00:00+00:00"))], "compiled")
    assert st.state == "missing"


def test_profile_and_device_requirements():
    certs = [("ci.json", _cert("2026-11-30T00:00:00+00:00", profile="ci")),
             ("cpu.json", _cert("2026-11-30T01:00:00+00:00", device="cpu"))]
    assert [s.certificate for s in gate.check(OPS, certs, "fused")] == ["cpu.json"] * 2          # the newest
    assert [s.certificate for s in gate.check(OPS, certs, "fused", profile="release")] == ["cpu.json"] * 2
    assert [s.certificate for s in gate.check(OPS, certs, "fused", profile="ci")] == ["ci.json"] * 2
    assert [s.certificate for s in gate.check(OPS, certs, "fused", device="cuda")] == ["ci.json"] * 2
    missing = gate.check(OPS, certs, "fused", profile="release", device="cuda")
    assert all(s.state == "missing" and "(profile release on cuda)" in s.detail for s in missing)


def test_cli_exit_codes_and_json(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_cert("2026-11-30T00:00:00+00:00")))
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(_cert("2026-12-01T00:00:00+00:00", sources=_stale("harness"))))
    assert main(["check", str(good), "--ops", "skinny_gemm,router_topk", "--profile", "release", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [o["op"] for o in out["ops"]] == ["skinny_gemm", "router_topk"]
    assert main(["check", str(stale), "--ops", "skinny_gemm"]) == 1
    assert "stale" in capsys.readouterr().out
    assert main(["check", str(good)]) == 1            # every op with a fused kernel: the others are missing
    assert main(["check", str(good), "--ops", "nope"]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "absent.json")]) == 2
