"""benchmarks/multiturn_bench.py on the tiny model: the conversations replay alike on every configuration, each turn
carries the answers before it, and the prefix cache cuts the prefill tokens computed."""

import json

import pytest

from benchmarks import multiturn_bench as mb

W = mb.Workload(conversations=3, turns=2, system_tokens=40, user_tokens=5, answer_min=2, answer_max=4,
                concurrency=2, vocab_size=512)


def test_workload_is_seeded_and_shares_the_system_prompt():
    assert W.system_prompt() == W.system_prompt() and len(W.system_prompt()) == 40
    assert W.user_message(0, 1) == W.user_message(0, 1) != W.user_message(1, 1)
    assert all(mb.FIRST_ID <= t < 512 for t in W.user_message(2, 0))
    assert {W.answer_tokens(c, t) for c in range(3) for t in range(2)} <= {2, 3, 4}
    assert W.longest_prompt == 40 + 2 * 5 + 4


@pytest.mark.parametrize("field, value, match", [("turns", 0, "turns: expected at least 1, got 0"),
                                                 ("answer_max", 1, "answer_max: expected >= answer_min = 2, got 1"),
                                                 ("vocab_size", 3, "vocab_size: expected more than 3 ids, got 3")])
def test_bad_workload(field, value, match):
    with pytest.raises(ValueError, match=match):
        mb.Workload(**{**W.__dict__, field: value})


def test_bad_configs():
    with pytest.raises(ValueError, match="--configs: expected TOPOLOGY-cache or TOPOLOGY-nocache"):
        mb.parse_args(["--configs", "agg-maybe"])


def test_cache_on_and_off_answer_alike_and_the_cache_computes_fewer_prefill_tokens(tmp_path):
    rc = mb.main(["--configs", "agg-cache,agg-nocache", "--conversations", "3", "--turns", "3", "--system-tokens",
                  "96", "--user-tokens", "8", "--answer-min", "3", "--answer-max", "6", "--concurrency", "2",
                  "--model-dir", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--no-progress",
                  # a checkpoint every 16 tokens: the short prompts here cross several
                  "--engine-args", "--block-size 8 --max-num-seqs 8 --max-num-batched-tokens 256 "
                                   "--num-kv-blocks 1024 --prefix-checkpoint-stride 2"])
    summary = json.loads((tmp_path / "out" / "multiturn_summary.json").read_text())
    on, off = summary["results"]
    assert rc == 0 and on["turns_completed"] == off["turns_completed"] == 9
    assert on["answers_sha256"] == off["answers_sha256"] and on["prompt_tokens_sent"] == off["prompt_tokens_sent"]
    # Every turn's prompt is the system prompt, the turns before with their answers, and its own message.
    assert off["prompt_tokens_sent"] == off["prefill_tokens_computed"] > 9 * 96
    (ratio,) = summary["ratios"]
    assert ratio["topology"] == "agg" and ratio["prefill_tokens_off_over_on"] > 2
