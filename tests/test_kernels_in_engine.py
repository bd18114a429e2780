"""The engine's steps on the Triton kernels (decode / verify state updates, paged attention and its KV write,
prefill conv and chunked scan, RMSNorm, residual add + RMSNorm, gated RMSNorm, relu2, the routed MoE experts) (`EngineConfig.kernels="triton"`; on CPU they run in Triton's interpreter) produce the greedy tokens, drafts and acceptance of the torch references."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (the Makefile installs it on CPU machines)")

import dataclasses  # noqa: E402

from baton.engine import llm_engine  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402
from tests.test_spec_decode import GREEDY, Log, new_engine, prompt_of, run, small_spec_model  # noqa: E402, F401


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [0, 2])
def test_engine_on_triton_kernels_equals_the_references(small_spec_model, k, monkeypatch):  # noqa: F811
    arrivals = [[("local", f"n{n}", prompt_of(n))] for n in (2, 9, 1, 5)]
    ref_engine = new_engine(small_spec_model, k, kernels="torch")
    ref_log = Log(ref_engine)
    ref = run(ref_engine, arrivals)

    calls = []
    kernels = resolve_kernels("triton", "cpu")
    spies = {}
    for name in ("conv_update", "state_update", "conv_update_verify", "state_update_verify", "paged_attention",
                 "write_kv", "conv_varlen", "chunk_scan", "rms_norm", "add_rms_norm", "gated_rms_norm", "relu2"):
        fn = getattr(kernels, name)

        def spy(*args, fn=fn, name=name, **kw):
            calls.append((name, fn.__name__))
            return fn(*args, **kw)
        spies[name] = spy
    monkeypatch.setattr(llm_engine, "resolve_kernels", lambda mode, device: dataclasses.replace(kernels, **spies))
    engine = new_engine(small_spec_model, k, kernels="triton")
    log = Log(engine)
    got = run(engine, arrivals)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert {r: [d for *_, d in rows] for r, rows in log.rows.items()} == \
        {r: [d for *_, d in rows] for r, rows in ref_log.rows.items()}
    assert calls and all(fn.endswith("_triton") for _, fn in calls)
    decode = {"conv_update_verify", "state_update_verify"} if k else {"conv_update", "state_update"}
    assert {n for n, _ in calls} == decode | {"paged_attention", "write_kv", "conv_varlen", "chunk_scan", "rms_norm",
                                           "add_rms_norm", "gated_rms_norm", "relu2"}


def test_bad_kernel_mode_is_refused():
    from baton.engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="kernels"):
        EngineConfig(kernels="cuda")


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [0, 2])
def test_fused_gemv_steps_equal_the_references(small_spec_model, k, monkeypatch):  # noqa: F811
    """Steps of at most 4 tokens run every linear layer with its add + norm / relu2 / gated norm fused in
    (`fused_gemv_max_tokens`), larger ones the separate kernels; greedy tokens and drafts stay the references'."""
    arrivals = [[("local", f"n{n}", prompt_of(n))] for n in (2, 9, 1, 5)]
    ref_engine = new_engine(small_spec_model, k, kernels="torch")
    ref_log = Log(ref_engine)
    ref = run(ref_engine, arrivals)

    prologues, sizes, separate = [], [], []
    kernels = resolve_kernels("triton", "cpu")
    orig, orig_norm = kernels.fused_linear, kernels.add_rms_norm

    def spy(a, *args, **kw):
        prologues.append(kw.get("prologue", "none"))
        sizes.append(a.shape[0])
        return orig(a, *args, **kw)

    def spy_norm(x, *args, **kw):
        separate.append(x.shape[0])
        return orig_norm(x, *args, **kw)
    spied = dataclasses.replace(kernels, fused_linear=spy, add_rms_norm=spy_norm)
    monkeypatch.setattr(llm_engine, "resolve_kernels", lambda mode, device: spied)
    engine = new_engine(small_spec_model, k, fused_gemv_max_tokens=4, kernels="triton")
    log = Log(engine)
    got = run(engine, arrivals)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert {r: [d for *_, d in rows] for r, rows in log.rows.items()} == \
        {r: [d for *_, d in rows] for r, rows in ref_log.rows.items()}
    assert {"none", "norm", "add_norm", "relu2"} <= set(prologues)  # none: out_proj and o_proj
    assert "gated_norm" not in prologues  # the gated norm stays a kernel: fused, every program would redo its RMS
    assert max(sizes) <= 4  # larger steps took the separate kernels
    assert max(separate) > 4  # ... and they ran (the final norm of fused steps is an add + norm too)


@pytest.mark.interpreter
def test_fused_gemv_steps_read_the_shared_expert_with_the_gemv(small_moe_model, monkeypatch):
    """In few-token steps a MoE layer's shared expert takes the GEMV kernel too (relu2 in down_proj's prologue), with
    the torch references' greedy tokens."""
    arrivals = [[("local", f"n{n}", prompt_of(n))] for n in (2, 9, 1, 5)]
    ref = run(new_engine(small_moe_model, 0, kernels="torch"), arrivals)
    shared = small_moe_model[0].moe_shared_expert_intermediate_size
    prologues = []
    kernels = resolve_kernels("triton", "cpu")
    orig = kernels.fused_linear

    def spy(a, *args, **kw):
        prologues.append((kw.get("prologue", "none"), a.shape[-1]))
        return orig(a, *args, **kw)
    monkeypatch.setattr(llm_engine, "resolve_kernels",
                        lambda mode, device: dataclasses.replace(kernels, fused_linear=spy))
    got = run(new_engine(small_moe_model, 0, fused_gemv_max_tokens=4, kernels="triton"), arrivals)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert ("relu2", shared) in prologues  # the shared expert's down_proj, relu2 fused


@pytest.fixture(scope="module")
def small_qwen_spec_model(tmp_path_factory):
    """qwen3.5-tiny cut to one Gated DeltaNet and one attention layer, with an MTP layer: its ops in the interpreter."""
    from baton.engine.loader import load_checkpoint
    from baton.engine.make_model import make_model

    out = make_model(tmp_path_factory.mktemp("small-qwen") / "m", "qwen3.5-tiny", mtp_layers=1, seed=11,
                     progress=False, tokenizer=False,
                     overrides={"vocab_size": 8, "num_hidden_layers": 2,
                                "layer_types": ["linear_attention", "full_attention"]})
    return load_checkpoint(out)


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [0, 2])
def test_qwen3_5_on_triton_kernels_equals_the_references(small_qwen_spec_model, k, monkeypatch):
    """The Gated DeltaNet kernels (decode or verify by replay, chunked prefill), its norm-then-gate and RoPE, beside
    the conv and attention kernels the Mamba2 path shares, give the references' tokens and drafts."""
    arrivals = [[("local", f"n{n}", prompt_of(n))] for n in (2, 9, 1, 5)]
    ref_engine = new_engine(small_qwen_spec_model, k, kernels="torch")
    ref_log = Log(ref_engine)
    ref = run(ref_engine, arrivals)
    calls = []
    kernels = resolve_kernels("triton", "cpu")
    names = ("gated_delta_decode", "gated_delta_verify", "gated_delta_prefill", "norm_gate", "conv_update",
             "conv_update_verify", "conv_varlen", "paged_attention", "write_kv", "rope")
    spies = {}
    for name in names:
        fn = getattr(kernels, name)

        def spy(*args, fn=fn, name=name, **kw):
            calls.append((name, fn.__name__))
            return fn(*args, **kw)
        spies[name] = spy
    monkeypatch.setattr(llm_engine, "resolve_kernels", lambda mode, device: dataclasses.replace(kernels, **spies))
    engine = new_engine(small_qwen_spec_model, k, kernels="triton")
    log = Log(engine)
    got = run(engine, arrivals)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert {r: [d for *_, d in rows] for r, rows in log.rows.items()} == \
        {r: [d for *_, d in rows] for r, rows in ref_log.rows.items()}
    assert calls and all(fn.endswith("_triton") for _, fn in calls)
    decode = {"conv_update_verify", "gated_delta_verify"} if k else {"conv_update", "gated_delta_decode"}
    assert {n for n, _ in calls} == decode | {"gated_delta_prefill", "norm_gate", "conv_varlen", "paged_attention",
                                           "write_kv", "rope"}


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [0, 2])
def test_qwen3_5_fused_gemv_steps_equal_the_references(small_qwen_spec_model, k, monkeypatch):
    """Qwen3.5's few-token steps read every projection with the GEMV kernel, the block's norm fused into the Gated
    DeltaNet's input projections, the attention's q/k/v and the MLP's gate/up (each one fused weight); greedy tokens
    and drafts stay the references'."""
    arrivals = [[("local", f"n{n}", prompt_of(n))] for n in (2, 9, 1, 5)]
    ref_engine = new_engine(small_qwen_spec_model, k, kernels="torch")
    ref_log = Log(ref_engine)
    ref = run(ref_engine, arrivals)
    kernels = resolve_kernels("triton", "cpu")
    orig = kernels.fused_linear
    widths = []

    def spy(a, weight, *args, **kw):
        widths.append((kw.get("prologue", "none"), weight.shape[0]))
        return orig(a, weight, *args, **kw)
    monkeypatch.setattr(llm_engine, "resolve_kernels",
                        lambda mode, device: dataclasses.replace(kernels, fused_linear=spy))
    engine = new_engine(small_qwen_spec_model, k, fused_gemv_max_tokens=4, kernels="triton")
    log = Log(engine)
    got = run(engine, arrivals)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert {r: [d for *_, d in rows] for r, rows in log.rows.items()} == \
        {r: [d for *_, d in rows] for r, rows in ref_log.rows.items()}
    cfg = engine.model.cfg
    gdn_in = cfg.gdn_conv_dim + 2 * cfg.linear_num_value_heads + cfg.gdn_value_dim
    qkv = (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    fused = {w for p, w in widths if p in ("norm", "add_norm")}
    assert {gdn_in, qkv, 2 * cfg.intermediate_size} <= fused  # each block's one GEMV with its norm


@pytest.fixture(scope="module")
def small_moe_model(tmp_path_factory):
    """tiny cut to one attention layer and one MoE layer (4 experts, top-2): the fused-MoE path in the interpreter."""
    from baton.engine.loader import load_checkpoint
    from baton.engine.make_model import make_model

    out = make_model(tmp_path_factory.mktemp("small-moe") / "m", "tiny", seed=13, progress=False, tokenizer=False,
                     overrides={"vocab_size": 8, "hybrid_override_pattern": "*E"})
    return load_checkpoint(out)


@pytest.mark.interpreter
def test_moe_engine_on_triton_kernels_equals_the_references(small_moe_model, monkeypatch):
    """The routed experts on the fused-MoE kernels (align, grouped GEMMs, top-k sum), beside the attention and norm
    kernels, give the references' greedy tokens over prefill chunks and decode steps."""
    arrivals = [[("local", f"n{n}", prompt_of(n))] for n in (2, 9, 1, 5)]
    ref = run(new_engine(small_moe_model, 0, kernels="torch"), arrivals)
    calls = []
    kernels = resolve_kernels("triton", "cpu")
    orig = kernels.moe_experts

    def spy(x, *args, **kw):
        calls.append(x.shape[0])
        return orig(x, *args, **kw)
    monkeypatch.setattr(llm_engine, "resolve_kernels",
                        lambda mode, device: dataclasses.replace(kernels, moe_experts=spy))
    got = run(new_engine(small_moe_model, 0, kernels="triton"), arrivals)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
    assert orig.__name__ == "moe_experts_triton" and min(calls) == 1 < max(calls)  # decode rows and prompt chunks
