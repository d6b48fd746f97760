"""The speculative-decoding contract for any rollback design (verify/spec_decode): the three correct
designs meet it over 64 steps at tiny and small, every planted rollback bug (property_tests/planted/
kda_spec.py) is reported by each property it breaks, a design that breaks the protocol is reported
without a traceback, and `verify-kernels spec-decode` prints a verdict per property, a repro, and exit 1.
CPU only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from property_tests.planted.kda_spec import SPEC_DECODE_CATALOGUE
from verify.spec_decode.contract import PROPERTIES, Drive, check_contract, draw_counts
from verify.spec_decode.design import CheckpointDesign, resolve_design

ROOT = Path(__file__).resolve().parent.parent
PLANTED = "property_tests.planted.kda_spec"
CORRECT = ("checkpoints", "one-token", "replay", "input-cache")


def _failed(report) -> set[str]:
    return {p for p, t in report.tally.items() if t.violations}


@pytest.mark.parametrize("config", ["tiny", "small"])
@pytest.mark.parametrize("design", CORRECT)
def test_correct_designs_meet_the_contract_over_64_steps(design, config):
    report = check_contract(resolve_design(design), Drive(config=config, batch=3, steps=64, seed=1))
    assert report.ok, "\n".join(map(str, report.violations))
    assert report.steps_run == 64
    for p in ("prefix", "accept-zero", "growth", "poison"):
        assert report.tally[p].checks > 0, f"{p} was never checked"
    # every correct design here is the reference's arithmetic, so it sits on the baseline: err = 1/k of the bound
    assert 0.2 < report.tally["growth"].worst_ratio <= 0.25 + 1e-9


@pytest.mark.parametrize("config", ["tiny", "small"])
@pytest.mark.parametrize("name, must, what", SPEC_DECODE_CATALOGUE, ids=[r[0] for r in SPEC_DECODE_CATALOGUE])
def test_planted_rollback_bugs_are_named_by_each_property_they_break(name, must, what, config):
    report = check_contract(resolve_design(f"{PLANTED}:{name}"), Drive(config=config, batch=3, steps=12, seed=2))
    assert must <= _failed(report), f"{what}: expected {sorted(must)}, got {sorted(_failed(report))}"
    assert not report.tally["run"].violations, report.violations
    for v in report.violations:         # each message says where and by how much
        assert f"step {v.step}" in str(v) and (("err/tol" in v.message) or ("differ bitwise" in v.message))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_fused_kda_decode_one_token_at_a_time_meets_the_contract_on_gpu():
    """The fused kernel judged as a design: one launch per draft token, checkpoints between them."""
    report = check_contract(resolve_design("one-token:fused.kda_decode:kda_decode", "cuda"),
                            Drive(config="small", batch=3, steps=64, device="cuda"))
    assert report.ok, "\n".join(map(str, report.violations))


def test_the_planted_input_cache_machinery_without_a_bug_passes():
    """_WritebackAt at the right length and count: the input-cache bugs are the bugs, not the subclass."""
    report = check_contract(resolve_design(f"{PLANTED}:input_cache_control"), Drive(config="tiny", batch=3, steps=16))
    assert report.ok, "\n".join(map(str, report.violations))


def test_the_poisoned_twin_alone_sees_a_design_that_reads_past_the_prefix():
    """accept_blends_by_arithmetic computes the right values, so prefix/accept-zero/growth pass; the NaN
    written past the accepted prefix reaches its committed state through 0 x NaN."""
    report = check_contract(resolve_design(f"{PLANTED}:accept_blends_by_arithmetic"),
                            Drive(config="tiny", batch=3, steps=4, seed=0))
    assert _failed(report) == {"poison"}
    assert any("rollback storage poisoned" in v.message for v in report.violations)


def test_accept_lengths_cover_zero_all_and_between_with_ragged_drafts():
    drive = Drive(batch=4, n_q=8, steps=64, seed=3)
    n0, a0 = draw_counts(drive, 0)
    assert torch.equal(a0, n0) and (n0 == 8).all()
    n1, a1 = draw_counts(drive, 1)
    assert (a1 == 0).all()
    seen_n, kinds = set(), set()
    for step in range(2, 64):
        n, a = draw_counts(drive, step)
        assert ((1 <= n) & (n <= 8)).all() and ((0 <= a) & (a <= n)).all()
        seen_n |= set(n.tolist())
        kinds |= {"zero" if x == 0 else "all" if x == m else "between" for x, m in zip(a.tolist(), n.tolist())}
    assert kinds == {"zero", "all", "between"} and len(seen_n) >= 4
    assert torch.equal(draw_counts(drive, 7)[1], draw_counts(drive, 7)[1])     # a pure function of (seed, step)


class _WrongLayout(CheckpointDesign):
    def committed(self):
        return self.conv_state.clone(), self.state.to(torch.bfloat16)


class _Raises(CheckpointDesign):
    def accept(self, accepted):
        if int(accepted.sum()) == 0:
            raise RuntimeError("nothing to accept")
        super().accept(accepted)


@pytest.mark.parametrize("design, words", [
    (_WrongLayout, "committed() state: expected (3, 16, 16, 16) torch.float32, got (3, 16, 16, 16) torch.bfloat16"),
    (_Raises, "accept() raised RuntimeError: nothing to accept"),
])
def test_a_design_that_breaks_the_protocol_is_a_run_violation_not_a_traceback(design, words):
    report = check_contract(design, Drive(config="tiny", batch=3, steps=4))
    assert _failed(report) == {"run"} and not report.ok
    assert any(words in v.message for v in report.violations), report.violations


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "verify.cli", "spec-decode", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "100"}, timeout=300)


def test_cli_passes_a_correct_design_and_fails_a_planted_one_with_a_repro():
    ok = _cli("--design", "input-cache:3", "--steps", "6", "--batch", "2", "--config", "small")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("PASS ") == 4 and "meets the contract over 6 steps" in ok.stdout
    bad = _cli("--design", f"{PLANTED}:accept_conv_only", "--steps", "3", "--batch", "2", "--json")
    assert bad.returncode == 1, bad.stderr
    out = json.loads(bad.stdout)
    assert set(out["properties"]) == set(PROPERTIES) and not out["ok"]
    zero = out["properties"]["accept-zero"]
    assert not zero["ok"] and zero["repro"].endswith("--steps 2 --batch 2 --n-q 8 --device cpu --seed 0")
    assert out["violations"][0]["step"] >= 0


@pytest.mark.parametrize("args, words", [
    (["--design", "nope"], "--design 'nope' is unknown; choose one of checkpoints, one-token, replay, input-cache"),
    (["--design", "replay:references.kda:nothere"], "the kda_decode after 'replay:' does not import"),
    (["--design", "checkpoints:references.kda"], "the module after 'checkpoints:' must hold kda_verify and kda_accept"),
    (["--design", "nomodule_xyz:make"], "cannot import module 'nomodule_xyz'"),
    (["--design", "references.kda:kda_decode"], "a kda_decode goes after 'one-token:'"),
    (["--design", "references.kda:QKV"], "is not callable"),
    (["--design", "one-token:references.kda:nothere"], "has no attribute 'nothere'"),
    (["--design", "input-cache:x"], "the window after 'input-cache:' must be an int >= 1, got 'x'"),
    (["--design", "checkpoints", "--n-q", "9"], "--n-q 9: must be in 1..8"),
    (["--design", "checkpoints", "--steps", "1"], "--steps 1: must be 2 or more"),
    (["--design", "checkpoints", "--batch", "33"], "--batch 33: must be in 1..32"),
    (["--design", "checkpoints", "--seed", "-1"], "--seed -1: must be in"),
    (["--design", "checkpoints", "--config", "huge"], "invalid choice: 'huge'"),
    (["--config", "tiny"], "the following arguments are required: --design"),
])
def test_bad_usage_is_one_line_and_exit_2(args, words, capsys):
    from verify.cli import main

    try:
        rc = main(["spec-decode", *args])
    except SystemExit as e:                 # argparse's own errors exit from the parser
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and words in lines[0], err
