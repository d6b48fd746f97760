"""verify-kernels bench on the layer ops (kda_layer, mla_layer): the stock layer as their declared peer,
one decode step per timed call, the launch counts in the row and in every output form, and (GPU) the
layer rows at the tiny config and at K3. The layers' byte counts are checked against a hand count in
test_bench.py (test_moved_bytes_match_the_real_tensors)."""
from __future__ import annotations

import pytest
import torch

import stock.layers
from property_tests.test_bench import CountingClock
from verify.bench import html, output, run, score, shapes
from verify.judge.candidates import reference_fn
from verify.model.case import Case
from verify.ops.registry import get_op, import_callable

LAYERS = ("kda_layer", "mla_layer")
FAST = {"min_calls": 2, "samples": 2, "replays": 1}


def _inputs(name, batch=2, config="tiny", seed=0):
    return get_op(name).make_inputs(Case(name, seed, batch, config, "bfloat16", "normal", 1, (("steps", 1),)))


# ------------------------------------------------------------------------------------ registry declarations
@pytest.mark.parametrize("name", LAYERS)
def test_the_stock_layer_step_is_a_whole_op_peer_and_one_step_is_benched(name):
    op = get_op(name)
    (peer,) = op.peers
    kind = name.split("_")[0]
    assert peer.name == "stock_layer" and not peer.part
    assert import_callable(peer.prepare) is getattr(stock.layers, f"{kind}_layer_step_peer")
    assert op.bench_knobs == ({"steps": 1},) and op.moved_bytes is not None
    got, notes = shapes.shapes_for(op, [1, 3, 8, 16], [1, 8, 64])
    assert [s.label for s in got][:3] == ["T=1 B=1 steps=1", "T=8 B=1 steps=1", "T=16 B=1 steps=1"]
    assert len(got) == 9 and any("T=3" in n for n in notes)


@pytest.mark.parametrize("name", LAYERS)
def test_a_one_step_case_holds_one_step_and_its_bytes_grow_with_the_steps(name):
    op = get_op(name)
    one = _inputs(name)
    assert one.tensors["x_steps"].shape[0] == 1
    three = op.make_inputs(Case(name, 0, 2, "tiny", "bfloat16", "normal", 1, (("steps", 3),)))
    # every step reads the layer's weights again: three steps move more than twice one step's bytes
    assert op.moved_bytes(three) > 2 * op.moved_bytes(one) > 0


# ------------------------------------------------------------------------------------ a layer row on the CPU
def _row(name, counter, checks=None, tp=1, inputs=None):
    op = get_op(name)
    inputs = shapes.rank_inputs(op, inputs or _inputs(name), tp)
    shape = shapes.Shape(name, tp, inputs.tensors["x_steps"].shape[1], (("steps", 1),))
    makers = {"eager": run._op_launch(reference_fn(op), op),
              "peer:stock_layer": run._peer_launch(import_callable(op.peers[0].prepare))}
    return run.bench_shape(op, shape, inputs, makers, {"compiled": "RuntimeError: not here"}, ["reference"],
                           CountingClock(), "cpu", timing_kw=FAST, checks=checks, counter=counter)


@pytest.mark.parametrize("name", LAYERS)
def test_every_timed_entry_of_a_layer_row_gets_its_launch_count(name):
    counted = []

    def counter(launch):
        counted.append(launch)
        launch()                        # the count runs the launch outside the timing, as count_launches does
        return {"kernels": 7 + len(counted), "method": "cuda_graph_nodes", "other": {}, "note": ""}
    row = _row(name, counter)
    assert set(row["launches"]) == {"eager", "peer:stock_layer"} == set(row["timings"]) - {"floor"}
    assert sorted(c["kernels"] for c in row["launches"].values()) == [8, 9] and len(counted) == 2
    assert row["bytes"] == get_op(name).moved_bytes(_inputs(name))


def test_a_count_that_fails_is_the_entrys_count_error_not_the_rows():
    def counter(launch):
        raise RuntimeError("cuGraphGetNodes failed with CUresult 1\nsecond line")
    row = _row("kda_layer", counter)
    assert row["launches"]["eager"] == {"error": "RuntimeError: cuGraphGetNodes failed with CUresult 1 "
                                                 f"(at test_bench_layers.py:{counter.__code__.co_firstlineno + 1})"}
    assert {"eager", "peer:stock_layer", "floor"} <= set(row["timings"])


def test_on_the_cpu_the_default_counter_reports_why_it_cannot_count():
    row = _row("kda_layer", run.count_entry)
    why = "RuntimeError: count_launches needs a CUDA device"
    assert all(c["error"].startswith(why) for c in row["launches"].values())


def test_the_stock_peer_computes_the_reference_step():
    op = get_op("kda_layer")
    row = _row("kda_layer", None, checks={"peer:stock_layer": import_callable(op.peers[0].prepare)})
    assert row["peer_checks"]["peer:stock_layer"].startswith("ok"), row["peer_checks"]
    assert "launches" not in row


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("candidate", ["peer:stock_layer", "fused"])
def test_a_rank_row_times_one_ranks_step_and_checks_it_against_the_reference(name, candidate):
    """T = 4: every entry runs one rank's step (its shards, the peers' partials given: verify.ops.layers.
    rank_inputs); the stock peer and the fused step launch (on the CPU through its stand-ins) are
    checked against the reference's tp form on the same inputs, and the floor's bytes are the rank's."""
    import fused.layers as FL

    op = get_op(name)
    step = getattr(FL, f"{name}_step_peer") if candidate == "fused" else import_callable(op.peers[0].prepare)
    row = _row(name, None, checks={candidate: step}, tp=4)
    assert row["tp"] == 4 and row["peer_checks"][candidate].startswith("ok"), row["peer_checks"]
    rank = shapes.rank_inputs(op, _inputs(name), 4)
    assert rank.params["tp"] == 4 and rank.tensors["peer_attn"].shape[1] == 3
    assert 0 < row["bytes"] == op.moved_bytes(rank) < op.moved_bytes(_inputs(name))


def test_a_rank_row_whose_peers_are_dropped_fails_its_check():
    """A step launch that leaves the peers' partials out of its all-reduces (an unsplit layer of the
    rank's shapes) is told apart from the reference's tp form."""
    import stock.layers as S

    def no_peers(tensors, params):
        kept = {n: t for n, t in tensors.items() if not n.startswith("peer_")}
        launch = S.step_launch("kda", {**kept, "peer_attn": torch.zeros_like(tensors["peer_attn"]),
                                       "peer_mlp": torch.zeros_like(tensors["peer_mlp"])}, params, graph=False)
        return launch
    row = _row("kda_layer", None, checks={"peer:stock_layer": no_peers}, tp=4)
    assert not row["peer_checks"]["peer:stock_layer"].startswith("ok"), row["peer_checks"]


def test_repeated_calls_of_an_mla_layer_step_write_the_same_slot():
    """seq_lens is put back before each call: without it the reference's pages run out within a few
    calls (the case has room for its own steps only)."""
    op = get_op("mla_layer")
    s = run._device_sets(_inputs("mla_layer"), 1, "cpu")[0]
    start = s.tensors["seq_lens"].clone()
    launch = run._op_launch(reference_fn(op), op)(s)
    outs = [launch() for _ in range(CALLS)]
    assert torch.equal(s.tensors["seq_lens"], start + 1) and all(map(torch.equal, outs[0], outs[-1]))
    bare = run._op_launch(reference_fn(op))(run._device_sets(_inputs("mla_layer"), 1, "cpu")[0])
    with pytest.raises(ValueError, match="block_table"):
        for _ in range(CALLS):
            bare()


def test_each_entry_starts_from_the_sets_integer_state():
    """The eager entry's last call leaves seq_lens one token on; the stock step launch prepared after it
    must start from the set's seq_lens, or a sequence one token short of a page boundary (seed 5: lengths
    31 and 7 at pages of 8, room for one step) writes past its last page (the K3 mla_layer rows at B = 8)."""
    inputs = _inputs("mla_layer", batch=4, seed=5)
    assert any((int(n) + 1) % 8 == 0 for n in inputs.tensors["seq_lens"])
    row = _row("mla_layer", None, inputs=inputs)
    assert set(row["timings"]) == {"eager", "peer:stock_layer", "floor"}, row["errors"]


def test_an_entrys_error_names_where_it_was_raised():
    op = get_op("kda_layer")

    def broken(s):
        def launch():
            raise TypeError("sequence item 1: expected str instance, int found")
        return launch
    row = run.bench_shape(op, shapes.Shape("kda_layer", 1, 2, (("steps", 1),)), _inputs("kda_layer"),
                          {"compiled": broken}, {}, ["reference"], CountingClock(), "cpu", timing_kw=FAST)
    assert row["errors"]["compiled"] == ("TypeError: sequence item 1: expected str instance, int found "
                                         "(at test_bench_layers.py:%d)" % (broken.__code__.co_firstlineno + 2))


CALLS = 20          # > the tiny config's page of 8 tokens: a sequence whose length grew would run out of pages


# ------------------------------------------------------------------------------------ output forms
def _rec(rows):
    return {"format": output.FORMAT, "created": "2026-01-01T00:00:00+00:00", "environment": {}, "command": "c",
            "options": {}, "certificate": None, "refused": [], "absent": [], "rows": rows, "not_reached": [],
            "notes": {}, "scores": {}}


def _layer_row(launches):
    t = {"median_us": 10.0, "p10_us": 9.0, "p90_us": 11.0, "samples": 2, "sets": 1, "calls": 2, "method": "graph"}
    return {"op": "kda_layer", "shape": "T=1 B=1 steps=1", "tp": 1, "batch": 1, "knobs": {"steps": 1},
            "bytes": 2_000_000, "sets": 1, "candidates": ["fused"], "errors": {}, "judged": {
                "fused": {"verdict": "met", "floor_ratio": 1.1, "misses": [], "unjudged": [],
                          "speedup": {"eager": 5.0, "peer:stock_layer": 2.0}}},
            "timings": {"eager": t, "peer:stock_layer": t, "fused": t, "floor": t}, "launches": launches}


LAUNCHES = {"eager": {"kernels": 412, "method": "profiler_kernels", "other": {}, "note": "host sync"},
            "peer:stock_layer": {"kernels": 96, "method": "cuda_graph_nodes", "other": {}, "note": ""},
            "fused": {"error": "RuntimeError: capture refused"}}


def test_the_layer_table_has_a_launches_column_per_entry_and_says_its_unit():
    rec = _rec([_layer_row(LAUNCHES)])
    head, body = output.op_table(rec, "kda_layer")
    cells = dict(zip(head, body[0]))
    assert (cells["eager launches"], cells["stock_layer launches"], cells["fused launches"]) == ("412*", "96", "error")
    md = output.markdown(rec)
    assert "| eager launches | stock_layer launches | fused launches |" in md
    assert "Times: us per layer step (one decode step per call" in md
    assert "Launches not counted:\n\n- kda_layer fused launches (T=1 B=1 steps=1): RuntimeError: capture refused" in md
    from rich.console import Console

    con = Console(record=True, width=300, color_system=None)
    output.print_report(con, rec, "bench.json")
    text = con.export_text()
    assert "kda_layer: us per layer step" in text and "fused launches (T=1 B=1 steps=1): RuntimeError" in text
    page = html.section(rec)
    assert "<td>96</td>" in page and "kernel launches per call" in page


def test_an_op_without_counts_keeps_its_table():
    row = _layer_row({})
    del row["launches"]
    row["op"], row["knobs"] = "router_topk", {}
    head, _ = output.op_table(_rec([row]), "router_topk")
    assert not any(h.endswith("launches") for h in head)
    assert output.unit(_rec([row]), "router_topk") == "us per call"


# ------------------------------------------------------------------------------------ candidates and inputs
@pytest.mark.parametrize("name", LAYERS)
def test_a_candidate_whose_module_declares_a_step_launch_is_timed_one_step_per_call(name):
    op = get_op(name)
    label = "stock.layers:layer_steps"
    makers, errors, whole = run.entries_for(op, {label: import_callable(label)}, device="cpu")
    assert set(whole) == {label, "peer:stock_layer"} and label not in errors
    assert whole[label] is getattr(stock.layers, f"{name}_step_peer")
    s = run._device_sets(_inputs(name, batch=3), 1, "cpu")[0]
    assert makers[label](s)().shape == s.tensors["x_steps"].shape[1:]          # [B, D]: one step
    assert run.step_launch_of(op, "references.layers:kda_layer_steps") is None  # no step launch: registry form
    assert run.step_launch_of(get_op("router_topk"), "compiled") is None


def test_layer_inputs_at_k3_on_a_device_take_their_weights_from_the_device_builder(monkeypatch):
    import dataclasses

    op = dataclasses.replace(get_op("kda_layer"), make_inputs=lambda case: ("registry", case.config))
    monkeypatch.setattr(shapes, "device_layer_inputs", lambda op, case, device: ("device", device))
    k3 = Case("kda_layer", 0, 1, "k3", "bfloat16", "normal", 1, (("steps", 1),))
    assert shapes.build_inputs(op, k3, "cuda") == ("device", "cuda")
    assert shapes.build_inputs(op, k3, "cpu") == ("registry", "k3")
    assert shapes.build_inputs(op, dataclasses.replace(k3, config="tiny"), "cuda") == ("registry", "tiny")
    other = dataclasses.replace(get_op("router_topk"), make_inputs=lambda case: "registry")
    assert shapes.build_inputs(other, k3, "cuda") == "registry"


@pytest.mark.parametrize("name", LAYERS)
def test_device_built_layer_inputs_are_the_registry_case_but_for_the_weights_values(name):
    op = get_op(name)
    case = Case(name, 0, 3, "tiny", "bfloat16", "normal", 1, (("steps", 1),))
    want, got = op.make_inputs(case), shapes.device_layer_inputs(op, case, "cpu")
    assert got.params == want.params and set(got.tensors) == set(want.tensors)
    for k, t in want.tensors.items():
        assert (got.tensors[k].shape, got.tensors[k].dtype) == (t.shape, t.dtype), k
    for k in ("x_steps", "blocks") + op.state:
        assert torch.equal(got.tensors[k], want.tensors[k]), k


# ------------------------------------------------------------------------------------ on the device
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STOCK = "stock.layers:layer_steps"


def _without_compiled(monkeypatch):
    """entries_for without torch.compile of the reference (minutes per layer; the bench command runs it)."""
    real = run.entries_for

    def entries(op, allowed, device="cuda"):
        makers, errors, whole = real(op, allowed, device)
        makers.pop(run.COMPILED, None)
        return makers, errors, whole
    monkeypatch.setattr(run, "entries_for", entries)


def _check_layer_row(row, label):
    for name in ("eager", "peer:stock_layer", label):
        assert row["timings"][name]["median_us"] > 0, (name, row["errors"])
    assert row["timings"]["floor"]["median_us"] > 0 and row["bytes"] > 0
    stock_count = row["launches"]["peer:stock_layer"]
    assert isinstance(stock_count["kernels"], int) and stock_count["kernels"] > 0, stock_count
    assert stock_count["method"] == "cuda_graph_nodes", stock_count
    assert row["launches"][label].get("kernels", 0) > 0, row["launches"][label]
    # a note, not a verdict: at K3 a token in the router's tie band may pick another expert
    assert not row["peer_checks"]["peer:stock_layer"].startswith("not checked"), row["peer_checks"]
    assert row["judged"][label]["verdict"] in (score.MET, score.MISS, score.INCOMPLETE)   # compiled: not timed here


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", LAYERS)
def test_a_layer_row_at_the_tiny_config_on_the_device(name, monkeypatch):
    from verify.bench.timing import GraphClock

    _without_compiled(monkeypatch)
    op = get_op(name)
    makers, errors, whole = run.entries_for(op, {STOCK: import_callable(STOCK)}, "cuda")
    shape = shapes.Shape(name, 1, 2, (("steps", 1),))
    row = run.bench_shape(op, shape, _inputs(name, batch=2), makers, errors, [STOCK], GraphClock(), "cuda",
                          checks=whole, counter=run.count_entry)
    _check_layer_row(row, STOCK)
    assert row["peer_checks"]["peer:stock_layer"].startswith("ok"), row["peer_checks"]
    assert row["peer_checks"][STOCK].startswith("ok"), row["peer_checks"]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", LAYERS)
def test_the_layer_table_at_k3_one_rank(name, monkeypatch, tmp_path):
    """bench_all at K3, B = 1, T = 1 and 16: each row timed per step with its launches (weights drawn on
    the device), the T = 16 row one rank's step (its shards, its peers' partials given)."""
    from verify.bench.timing import GraphClock

    _without_compiled(monkeypatch)
    op = get_op(name)
    plan = run.Plan(ops=[op], candidates={name: [STOCK]}, allowed={name: {STOCK: import_callable(STOCK)}},
                    tps=[1, 16], batches=[1], device="cuda")
    res = run.bench_all(plan, GraphClock(), lambda row, st: None)
    assert [(r["tp"], r["batch"], r["knobs"]) for r in res["rows"]] == [(1, 1, {"steps": 1}), (16, 1, {"steps": 1})]
    rec = _rec(res["rows"])
    head, body = output.op_table(rec, name)
    for row, line in zip(res["rows"], body):
        _check_layer_row(row, STOCK)
        assert int(dict(zip(head, line))["stock_layer launches"]) == row["launches"]["peer:stock_layer"]["kernels"]
        print(f"\n{name} K3 T={row['tp']} B=1: " + ", ".join(f"{k} {v['median_us']:.1f} us" for k, v in row["timings"].items())
              + "; launches " + ", ".join(f"{k} {v.get('kernels')}" for k, v in row["launches"].items()))


def test_certificate_records_launches_per_step_of_layer_candidates():
    """A passing layer verdict on CUDA gets its candidate's launches per step in the certificate (the
    count is faked here: no GPU); other ops, failing verdicts, candidates without a step launch and
    CPU runs get none; a count that raises is recorded as its error, the run goes on."""
    from types import SimpleNamespace

    from verify.bench.launches import LaunchCount, record_layer_launches

    seen = []

    def fake_count(launch, warmup):
        seen.append(launch())              # the step runs (stock layer, CPU tensors)
        return LaunchCount(11, "fake")

    def verdict(op, cand, status="pass"):
        return SimpleNamespace(op=op, candidate=cand, status=status)
    cert = {"ops": {n: {} for n in ("kda_layer", "mla_layer", "skinny_gemm")}}
    verdicts = [verdict("kda_layer", "stock.layers:layer_steps"), verdict("mla_layer", "stock.layers:layer_steps", "fail"),
                verdict("kda_layer", "reference"), verdict("skinny_gemm", "fused")]
    assert record_layer_launches(cert, verdicts, "cpu", fake_count) == []
    lines = record_layer_launches(cert, verdicts, "cuda", fake_count, place=lambda t: t)
    assert cert["ops"]["kda_layer"]["launches"]["stock.layers:layer_steps"]["kernels"] == 11
    assert "launches" not in cert["ops"]["mla_layer"] and "launches" not in cert["ops"]["skinny_gemm"]
    assert set(cert["ops"]["kda_layer"]["launches"]) == {"stock.layers:layer_steps"}
    assert len(seen) == 1 and seen[0].shape[0] == 4 and len(lines) == 1 and "11 kernel launches" in lines[0]

    def broken(launch, warmup):
        raise RuntimeError("capture failed: a host sync\nmore")
    lines = record_layer_launches(cert, verdicts[:1], "cuda", broken, place=lambda t: t)
    assert cert["ops"]["kda_layer"]["launches"]["stock.layers:layer_steps"]["error"] == \
        "RuntimeError: capture failed: a host sync"
    assert "not counted" in lines[0]


def test_report_shows_the_launches_per_layer_step():
    """`verify-kernels report` renders the certificate's launch counts (and a count's error)."""
    from verify.record.reporters.html import render

    cert = {"created": "2026-12-04T00:00:00+00:00", "environment": {}, "options": {}, "ops": {
        "kda_layer": {"verdicts": {}, "cases": {}, "sources": {}, "launches": {
            "fused.layers:layer_steps": {"kernels": 17, "method": "cuda_graph_nodes", "other": {"memcpy": 1},
                                         "case": "{\"op\":\"kda_layer\"}"},
            "stock.layers:layer_steps": {"error": "RuntimeError: capture failed", "case": "{}"}}}}}
    page = render(cert)
    assert "Kernel launches per layer step" in page
    assert "<td>17</td>" in page and "not counted: RuntimeError: capture failed" in page
    assert "Kernel launches per layer step" not in render({**cert, "ops": {"kda_layer": {"verdicts": {}}}})


def test_a_rank_rows_peers_are_narrowed_with_its_batch():
    """Inputs built once at the run's largest batch: a smaller row takes the first B sequences of the
    peers' partials as of every other batched tensor (the step would refuse mismatched peers)."""
    op = get_op("kda_layer")
    small = shapes.take_batch(op, shapes.rank_inputs(op, _inputs("kda_layer", batch=3), 4), 2)
    assert small.tensors["x_steps"].shape[1] == 2
    assert small.tensors["peer_attn"].shape[2] == small.tensors["peer_mlp"].shape[2] == 2


def test_one_device_built_ops_inputs_are_kept_at_a_time(monkeypatch):
    """Two K3 layers' inputs (16 GB each) with their rank forms filled an 80 GB card: building a layer
    op's inputs drops another layer op's; other ops' inputs stay for the run."""
    built = []

    def fake_build(op, case, device="cpu"):
        built.append(op.name)
        return _inputs(op.name) if op.family == "layers" else get_op(op.name).make_inputs(
            Case(op.name, 0, 2, "tiny", "bfloat16", "normal", 1, ()))
    monkeypatch.setattr(shapes, "build_inputs", fake_build)
    cache = shapes.InputCache("cpu")
    kda, mla, rms = get_op("kda_layer"), get_op("mla_layer"), get_op("attn_res_rmsnorm")
    knobs = (("steps", 1),)
    cache.inputs(rms, shapes.Shape("attn_res_rmsnorm", 1, 2, ()), 2)
    cache.inputs(kda, shapes.Shape("kda_layer", 4, 2, knobs), 2)
    assert {k[0] for k in cache.held()} == {"attn_res_rmsnorm", "kda_layer"}
    cache.inputs(mla, shapes.Shape("mla_layer", 1, 2, knobs), 2)
    assert {k[0] for k in cache.held()} == {"attn_res_rmsnorm", "mla_layer"}
    cache.inputs(kda, shapes.Shape("kda_layer", 1, 2, knobs), 2)          # a later round: rebuilt
    assert built == ["attn_res_rmsnorm", "kda_layer", "mla_layer", "kda_layer"]
    assert {k[0] for k in cache.held()} == {"attn_res_rmsnorm", "kda_layer"}
    cache.inputs(kda, shapes.Shape("kda_layer", 4, 2, knobs), 2)          # same op: kept, not rebuilt
    assert built[-1] == "kda_layer" and len(built) == 4
