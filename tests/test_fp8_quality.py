"""benchmarks/fp8_quality.py end to end on the CPU (`--smoke`)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_quality.py"
_spec = importlib.util.spec_from_file_location("fp8_quality", _PATH)
fp8_quality = importlib.util.module_from_spec(_spec)
sys.modules["fp8_quality"] = fp8_quality  # dataclasses look their module up
_spec.loader.exec_module(fp8_quality)


def test_smoke_reports_every_variant(tmp_path, capsys):
    assert fp8_quality.main(["--smoke", "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert "fp8 " in printed and "fp8-block" in printed and "kv-fp8" in printed
    res = json.loads((tmp_path / "r.json").read_text())
    assert [r["variant"] for r in res["rows"]] == ["fp8", "fp8-block", "kv-fp8"]
    assert res["rows"][2]["max_dlogit"] > 0  # the FP8 KV cache did quantize
    for r in res["rows"]:
        # a random tiny model: e4m3 weights (or KV) move its logits by a few percent, its perplexity by about as much
        assert abs(r["ppl_delta"]) < 0.1 and r["max_dlogit"] < 0.15 and r["argmax_agree"] > 0.8


def test_a_perplexity_limit_fails_the_run_on_the_variants_over_it(capsys):
    rows = [fp8_quality.Row("fp8", 10.3, 0.03, 0.1, 0.9), fp8_quality.Row("fp8-block", 10.05, 0.005, 0.1, 0.9),
            fp8_quality.Row("kv-fp8", 9.9, -0.01, 0.01, 0.99), fp8_quality.Row("nan", float("nan"), float("nan"), 1, 0)]
    assert [r.variant for r in fp8_quality.over_limit(rows, 0.01)] == ["fp8", "nan"]
    assert [r.variant for r in fp8_quality.over_limit(rows, 0.05)] == ["nan"]
    assert fp8_quality.main(["--smoke", "--max-ppl-increase", "0.1"]) == 0
    assert "every variant within +10.00% perplexity" in capsys.readouterr().out
