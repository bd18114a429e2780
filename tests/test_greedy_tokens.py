"""benchmarks/greedy_tokens.py: the same tokens on every run of one commit, through the disaggregated copy too, and
a difference between two runs' files is reported (exit 1)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import greedy_tokens as gt  # noqa: E402


def test_disaggregated_copy_gives_the_aggregated_tokens_and_a_changed_token_is_reported(tmp_path, capsys):
    from baton.engine.make_model import make_model

    model = tmp_path / "tiny"
    make_model(model, preset="tiny", seed=5, progress=False)
    a = tmp_path / "a.json"
    args = ["--model", str(model), "--device", "cpu", "--requests", "3", "--max-prompt", "40", "--max-tokens", "4"]
    assert gt.main([*args, "--configs", "k0,disagg_k0", "--out", str(a)]) == 0
    tokens = json.loads(a.read_text())["tokens"]
    assert [len(t) for t in tokens["k0"]] == [4, 4, 4]
    # R1: prefill N-1 there, token N here, from copied caches: what one engine emits.
    assert tokens["disagg_k0"] == tokens["k0"]

    assert gt.main(["--compare", str(a), str(a)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("identical")
    changed = json.loads(a.read_text())
    changed["tokens"]["k0"][1][2] += 1
    b = tmp_path / "b.json"
    b.write_text(json.dumps(changed))
    assert gt.main(["--compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "| k0 | 3 | 2 |" in out and "1 config(s) differ" in out
