"""A Qwen3.5 checkpoint served disaggregated (router -> prefill node -> NIXL, the Gated DeltaNet conv + recurrent
state and the KV blocks -> decode node): greedy tokens through the gRPC SDK and the OpenAI HTTP API equal the
offline engine's, for prompt lengths 1, 2, 3, KV block±1, GDN chunk±1 and a long one, all in flight at once; a text
prompt and a chat message go through the checkpoint's tokenizer and chat template; every block and state slot is
free on both nodes afterwards. With the checkpoint's MTP layer drafting 2 tokens per step, the tokens are the same.
"""

import asyncio
import json

import openai
import pytest

from baton.cli.cluster import Cluster
from baton.client import AsyncClient
from baton.engine.config_qwen3_5 import GDN_CHUNK_SIZE
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import TOKENIZER_CONFIG_FILE, load_tokenizer
from tests.node_faults import all_free
from tests.test_e2e import BLOCK, ENGINE_ARGS, offline, prompts_for
from tests.test_metrics import scrape
from tests.test_openai_http import CHAT_TEMPLATE

LENGTHS = (1, 2, 3, BLOCK - 1, BLOCK + 1, GDN_CHUNK_SIZE - 1, GDN_CHUNK_SIZE + 1, 200)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e-qwen") / "qwen3.5-tiny"
    make_model(out, preset="qwen3.5-tiny", mtp_layers=1, seed=5, progress=False)
    cfg = json.loads((out / TOKENIZER_CONFIG_FILE).read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(cfg))
    return str(out)


@pytest.mark.parametrize("k", [0, 2], ids=["no-drafts", "mtp-2"])
def test_greedy_through_grpc_and_openai_http_equals_offline(model, tmp_path, k):
    from transformers import PreTrainedTokenizerFast

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = prompts_for(LENGTHS)
    tok = load_tokenizer(model)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = tok.encode(PreTrainedTokenizerFast.from_pretrained(model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False))
    text_ids = tok.encode("The capital of France is")
    ref = offline(model, [*prompts, text_ids, chat_ids], params)  # without drafts: K > 0 must not change a token
    engine_args = (*ENGINE_ARGS, "--speculative-tokens", str(k)) if k else ENGINE_ARGS
    with Cluster(model, prefill_workers=1, decode_workers=1, engine_args=engine_args,
                 log_dir=str(tmp_path / "logs")) as cluster:

        async def main():
            async with AsyncClient(cluster.router_addr) as client:
                return await asyncio.gather(*(client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True)
                                              for p in prompts))

        outs = asyncio.run(main())
        assert [list(o.token_ids) for o in outs] == ref[:len(prompts)]
        http = openai.OpenAI(base_url=cluster.router_http_url + "/v1", api_key="unused", max_retries=0,
                             http_client=openai.DefaultHttpxClient(trust_env=False))
        greedy = {"max_tokens": MAX_TOKENS, "temperature": 0,
                  "extra_body": {"ignore_eos": True, "return_token_ids": True}}
        out = http.completions.create(model="qwen3.5-tiny", prompt=prompts[-1], **greedy)
        assert out.choices[0].model_dump()["token_ids"] == ref[len(prompts) - 1]
        out = http.completions.create(model="qwen3.5-tiny", prompt="The capital of France is", **greedy)
        assert out.choices[0].text == tok.decode(ref[-2])
        chat = http.chat.completions.create(model="qwen3.5-tiny", messages=messages, **greedy)
        assert chat.choices[0].message.content == tok.decode(ref[-1])
        assert chat.usage.prompt_tokens == len(chat_ids)
        free, loads = all_free(cluster)
        assert free, loads
        decode = scrape(f"http://{cluster.host}:{cluster.node_ports[-1] + 2000}/metrics")
        # Every request with tokens to prefill (N-1 > 0) had them come over NIXL, none prefilled locally instead.
        remote = sum(len(p) > 1 for p in prompts) + 3  # the HTTP completions and chat prompts are longer
        assert sum(decode["baton_node_transfers_total"].values()) == remote
        assert not any(decode["baton_node_transfer_fallbacks_total"].values())
        if k:  # the drafter ran on the decode node, from its KV that came with the target's (R8)
            assert sum(decode["baton_node_spec_drafted_tokens_total"].values()) > 0
