"""Structured output at two tensor-parallel ranks (`start_engine`: rank 0 here, rank 1 its own process): every rank
holds the grammars and masks its rows alike, so the output equals one rank's and matches the grammar."""

from __future__ import annotations

import json
import subprocess
import sys

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.structured_output import StructuredOutput
from baton.engine.tokenizer import load_tokenizer

ENGINE = {"block_size": 8, "max_num_batched_tokens": 32, "max_num_seqs": 4, "num_kv_blocks": 128, "device": "cpu"}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}}
PROMPTS = [[5, 6, 7], [(7 * i) % 500 + 3 for i in range(20)]]
SCRIPT = """
import json, sys
from baton.engine.engine_config import EngineConfig
from baton.engine.parallel.rank_processes import start_engine
from baton.engine.sampling_params import SamplingParams
from baton.engine.structured_output import StructuredOutput
engine = start_engine(sys.argv[1], EngineConfig(**{config}))
params = [SamplingParams(max_tokens=30, temperature=t, seed=1, structured_output=StructuredOutput("json_schema",
          {schema!r})) for t in (0.0, 1.0)]
outs = engine.generate({prompts}, params)
print(json.dumps([list(o.token_ids) for o in outs]), flush=True)
engine.close()
"""


def test_two_ranks_apply_the_grammar_as_one(tmp_path):
    model = make_model(tmp_path / "tiny", preset="tiny", seed=5, progress=False)
    params = [SamplingParams(max_tokens=30, temperature=t, seed=1,
                             structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA))) for t in (0.0, 1.0)]
    ref = [list(o.token_ids) for o in LLMEngine.from_pretrained(model, EngineConfig(**ENGINE)).generate(PROMPTS, params)]
    tok = load_tokenizer(model)
    for ids in ref:
        assert set(json.loads(tok.decode(ids))) == {"n"}
    script = SCRIPT.format(config={**ENGINE, "tensor_parallel_size": 2}, schema=json.dumps(SCHEMA), prompts=PROMPTS)
    proc = subprocess.run([sys.executable, "-c", script, str(model)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == ref
