"""benchmarks/launch_probe.py: variants parse or fail naming what was expected, patch exactly the launch
settings they name and restore them, and a smoke run (tiny preset, CPU) measures every variant in every
round."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")

import baton.engine.ops.attention.kernel as ta  # noqa: E402
import baton.engine.ops.conv.kernel as tc  # noqa: E402
import baton.engine.ops.linear.kernel as tg  # noqa: E402
import baton.engine.ops.ssm_update.kernel as ts  # noqa: E402
from benchmarks.launch_probe import Setting, main, parse_variant, patched  # noqa: E402


def test_variants_parse():
    assert parse_variant("base") == ()
    assert parse_variant(" ssu.warps=1+attn.block_n=128 ") == (Setting("ssu", "warps", (1,)),
                                                                Setting("attn", "block_n", (128,)))
    assert parse_variant("gemv.longk=64x256x4x4x2") == (Setting("gemv", "longk", (64, 256, 4, 4, 2)),)


@pytest.mark.parametrize("text,match", [
    ("ssu", "expected 'base' or op.knob=value"),
    ("ssu.threads=2", "expected one of .*ssu.warps.*got 'ssu.threads'"),
    ("mlp.warps=2", "got 'mlp.warps'"),
    ("ssu.warps=two", "ssu.warps expected a positive integer, got 'two'"),
    ("attn.block_n=0", "expected a positive integer, got '0'"),
    ("gemv.wide=64x128", r"gemv.wide expected BNxBKxWARPSxSTAGES\[xSPLIT\], got '64x128'"),
])
def test_bad_variants_say_what_was_expected(text, match):
    with pytest.raises(ValueError, match=match):
        parse_variant(text)


def test_patched_overrides_what_it_names_and_restores_everything():
    before = [ts._launch_config, ta._launch_config, ta.DECODE_STAGES, tc._default_block_c, tc._num_warps,
              tg.default_tiles]
    ssu_256 = ts._launch_config(64, 128, batch=256)
    attn_decode = ta._launch_config(4, 128, 1, 256, 256)
    attn_prefill = ta._launch_config(4, 128, None, 4096, 2)
    wide_8 = tg.default_tiles(8, 18560, 4096, True)
    variant = "ssu.warps=2+attn.block_n=64+attn.stages=3+conv.block_c=128+gemv.wide=32x256x4x3"
    with patched(parse_variant(variant)):
        assert ts._launch_config(64, 128, batch=256) == (*ssu_256[:2], 2)
        verify = before[0](64, 128, verify=True, batch=256)
        assert ts._launch_config(64, 128, verify=True, batch=256) == verify
        assert ta._launch_config(4, 128, 1, 256, 256) == (*attn_decode[:2], 64, *attn_decode[3:])
        assert ta._launch_config(4, 128, None, 4096, 2) == attn_prefill  # prefill tiles untouched
        assert ta.DECODE_STAGES == 3 and tc._default_block_c(256, 10240) == 128
        assert tc._num_warps(256) == before[4](256)  # not named: the tree's
        t = tg.default_tiles(8, 18560, 4096, True)
        assert (t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages) == (wide_8.block_m, 32, 256, 4, 3)
        # One row keeps its own kernel; another class of layer keeps its tile.
        assert tg.default_tiles(1, 18560, 4096, True) == before[5](1, 18560, 4096, True)
        assert tg.default_tiles(8, 4096, 8192, True) == before[5](8, 4096, 8192, True)
    after = [ts._launch_config, ta._launch_config, ta.DECODE_STAGES, tc._default_block_c, tc._num_warps,
             tg.default_tiles]
    assert all(a is b for a, b in zip(after, before, strict=True))


def test_smoke_measures_every_variant_in_every_round(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert main(["--smoke", "--variants", "ssu.warps=1,attn.block_n=128", "--rounds", "2", "--no-progress",
                 "--json", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert sorted((p["variant"], p["round"]) for p in points) == sorted(
        (v, r) for v in ("base", "ssu.warps=1", "attn.block_n=128") for r in (0, 1))
    assert all(p["batch"] == 4 and p["step_ms"] > 0 and p["ratio"] > 0 for p in points)
    table = capsys.readouterr().out
    assert "| 4 | `base` |" in table and "+0.00 %" in table
    # What `base` ran, as the tree picks it at this batch (4 rows: two warps, key tiles of 64).
    base = json.loads(out.read_text())["meta"]["base"]["4"]
    assert parse_variant(base) and "ssu.warps=2" in base and "attn.block_n=64" in base
    assert f"- batch 4: `base` = `{base}`" in table
