"""benchmarks/host_bench.py in its smoke mode: the per-step numbers are positive and the split sums to the total;
and the fast constructions the decode host path uses build the same objects as the dataclasses' own __init__."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from baton.engine.llm_engine import RequestOutput
from baton.engine.scheduler_output import ScheduledRow

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "host_bench.py"
_spec = importlib.util.spec_from_file_location("host_bench", _PATH)
hb = importlib.util.module_from_spec(_spec)
sys.modules["host_bench"] = hb  # dataclasses look their module up
_spec.loader.exec_module(hb)


@pytest.mark.parametrize("spec", [0, 2])
def test_smoke_numbers_are_sane(spec, capsys):
    argv = ["--smoke"] + (["--spec", str(spec)] if spec else [])
    r = hb.bench(argv)
    # (verify steps chained on the one in flight are not scheduled: no schedule() time)
    assert all(v > 0 for name, v in r.items() if not (spec and name == "schedule")), r
    parts = r["schedule"] + r["execute_host"] + r["update_outputs"]
    assert parts == pytest.approx(r["total"], rel=1e-6)
    assert "schedule" in capsys.readouterr().out


def test_main_runs(capsys):
    assert hb.main(["--smoke"]) == 0
    assert "total" in capsys.readouterr().out


def test_bad_flags_fail():
    with pytest.raises(ValueError):
        hb.bench(["--smoke", "--spec", "-1"])


def _same_as_init(obj, cls):
    """obj has exactly cls's fields and equals cls(**those fields)."""
    names = {f.name for f in dataclasses.fields(cls)}
    assert set(vars(obj)) == names
    again = cls(**{n: getattr(obj, n) for n in names})
    assert obj == again and hash(obj) == hash(again) and repr(obj) == repr(again)
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj.request_id = "x"


@pytest.mark.parametrize("spec", [0, 2])
def test_fast_rows_and_outputs_equal_the_dataclass_init(tmp_path, spec):
    from baton.engine.make_model import make_model

    make_model(tmp_path, "tiny", mtp_layers=1 if spec else 0, progress=False, tokenizer=False)
    engine = hb.build(tmp_path, batch=4, context=20, steps=3, k=spec)
    # One step at a time from here (the step in flight read first): the test drives a step by hand.
    engine.depth = 0
    engine.step()
    out = engine.scheduler.schedule()
    assert out.rows and all(r.is_decode for r in out.rows)
    for row in out.rows:
        _same_as_init(row, ScheduledRow)
    result = engine.runner.execute(out)
    engine.step_update.update(out, result.sampled, result.drafts)
    outputs = engine.step()
    assert outputs
    for o in outputs:
        _same_as_init(o, RequestOutput)
        req = engine.scheduler.requests[o.request_id]
        assert o.token_ids == tuple(req.output_token_ids) and o.new_token_ids


def test_verify_steps_run_the_real_chained_launches(tmp_path):
    """With drafts, the timed steps are `SpecRunner.launch_chained` + `read_verify` on the stand-in graph's packed
    results (async scheduling: each chained on the one in flight): every draft accepted, so each request gains
    1 + K tokens a step."""
    from baton.engine.make_model import make_model

    make_model(tmp_path, "tiny", mtp_layers=1, progress=False, tokenizer=False)
    k = 2
    engine = hb.build(tmp_path, batch=4, context=20, steps=6, k=k)
    calls = []
    chained = engine.runner.launch_chained
    engine.runner.launch_chained = lambda prev, ids, *a: calls.append(len(ids)) or chained(prev, ids, *a)
    running = list(engine.scheduler.running)
    before = {r.request_id: len(r.output_token_ids) for r in running}
    drafted, accepted = engine.stats.spec_drafted, engine.stats.spec_accepted
    for _ in range(3):
        engine.step()
    assert calls == [4, 4, 4]
    assert all(len(r.output_token_ids) - before[r.request_id] == 3 * (1 + k) for r in running)
    assert engine.stats.spec_accepted - accepted == engine.stats.spec_drafted - drafted == 3 * 4 * k
