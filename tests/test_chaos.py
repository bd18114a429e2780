"""The chaos benchmark's short run (benchmarks/chaos.py: real router and node processes, tiny model, loopback):
client aborts, injected transfer faults and a prefill and a decode node SIGKILLed and restarted mid-run, with no
request hung, no wrong token, nothing leaked on any node and failures within the in-flight count at the kills;
and the test-only fault hook (`baton.transfer.fault_injection`) on its own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from baton.engine.make_model import make_model
from baton.transfer.fault_injection import (
    FAULT_RATE_ENV,
    FAULT_SEED_ENV,
    InjectedTransferFault,
    TransferFaults,
)

_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("chaos", _ROOT / "benchmarks" / "chaos.py")
chaos = importlib.util.module_from_spec(_spec)
sys.modules["chaos"] = chaos  # dataclasses look their module up
_spec.loader.exec_module(chaos)


def _pull(faults: TransferFaults, rid: str) -> str | None:
    """Where a pull failed ("before" / "after" the READ), or None: the Puller's two checks."""
    for point in ("before", "after"):
        try:
            faults.check(rid, point)
        except InjectedTransferFault:
            return point
    return None


def test_fault_hook_fails_its_rate_of_pulls_seeded_at_both_points():
    faults = TransferFaults.from_environ({FAULT_RATE_ENV: "0.05", FAULT_SEED_ENV: "3"})
    points = [_pull(faults, f"r{i}") for i in range(20_000)]
    failed = [p for p in points if p is not None]
    # 1,000 expected failures: binomial sd ~31, so 15 % is > 4 sd.
    assert len(failed) == pytest.approx(1000, rel=0.15)
    assert faults.injected == len(failed)
    assert {"before", "after"} <= set(failed)
    again = TransferFaults(0.05, seed=3)
    assert [_pull(again, f"r{i}") for i in range(20_000)] == points
    every = TransferFaults(1.0)
    assert [_pull(every, "r") for _ in range(10)] == ["before"] * 10


def test_fault_hook_is_off_unless_asked_and_refuses_bad_values():
    off = TransferFaults.from_environ({})
    assert [_pull(off, f"r{i}") for i in range(1000)] == [None] * 1000 and off.injected == 0
    for bad in ("1.5", "-0.1", "nan", "five"):
        with pytest.raises(ValueError, match=FAULT_RATE_ENV):
            TransferFaults.from_environ({FAULT_RATE_ENV: bad})
    with pytest.raises(ValueError, match=FAULT_SEED_ENV):
        TransferFaults.from_environ({FAULT_RATE_ENV: "0.1", FAULT_SEED_ENV: "x"})


def test_report_names_every_count_that_must_be_zero():
    cfg = chaos.ChaosConfig(requests=4, kills=((0.5, "decode-0"),))
    results = [chaos.Result(0, chaos.ANSWERED, "OK", 8, False), chaos.Result(1, chaos.HUNG, "GUARD", 0, False),
               chaos.Result(2, chaos.FAILED, "UNAVAILABLE", 3, True),
               chaos.Result(3, chaos.FAILED, "INTERNAL", 0, False)]
    nodes = [chaos.NodeState("prefill-0", 0, 0, 1, 0, 0, True, 0), chaos.NodeState("decode-0", 2, 1, 0, 0, 0, True, 3),
             chaos.NodeState("decode-1", -1, -1, -1, -1, -1, False, 0)]
    report = chaos.Report(cfg, 1.0, results, [chaos.Kill("decode-0", 2, 1, 1, None)], nodes, ["router"])
    problems = "\n".join(report.problems())
    for text in ("hung: 1", "wrong-tokens: 1", "failed-with-status: 2 > 1", "prefill-0: leaked blocks 0, slots 0, "
                 "held leases 1", "decode-0: leaked blocks 2, slots 1", "router: not running",
                 "decode-0: not back", "decode-1: did not answer Load"):
        assert text in problems, problems
    assert "FAILED: " in report.table()
    clean = chaos.Report(cfg, 1.0, results[:1], [chaos.Kill("decode-0", 2, 1, 0, 5.0)], nodes[:0], [])
    assert clean.problems() == [] and "OK: every must-be-zero count is 0" in clean.table()


def test_short_chaos_run_hangs_nothing_answers_exactly_and_leaks_nothing(tmp_path):
    model = make_model(tmp_path / "tiny", preset="tiny", seed=5, progress=False, tokenizer=False)
    # Kills early in the run, so that both restarted nodes rejoin while requests still flow.
    cfg = chaos.ChaosConfig(requests=300, concurrency=12, seed=1, max_tokens=16, deadline_s=20.0, settle_s=40.0,
                            kills=((0.15, "prefill"), (0.3, "decode")))
    report = chaos.run(cfg, str(model), str(tmp_path / "logs"), progress=False)
    table = report.table()
    assert report.problems() == [], table
    assert len(report.results) == cfg.requests and report.count(chaos.ABORTED) > 0, table
    assert report.injected_faults > 0, table
    assert [k.name.rpartition("-")[0] for k in report.kills] == ["prefill", "decode"], table
