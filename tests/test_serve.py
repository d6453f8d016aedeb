"""`mileage serve`: SGLang's native API in front of the in-process engine, and the SGLang
client engine against it (request shape, seeding, weight versions)."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from mileage.errors import UserError
from mileage.models.hf import load_causal_lm
from mileage.models.lm_head import Fp32LogitsLinear
from mileage.precision import resolve, set_precision
from mileage.rollout.engine import LocalEngine, SamplingParams
from mileage.rollout.engines.base import SamplingSeed
from mileage.rollout.engines.http import BadReply, post_json
from mileage.rollout.engines.sglang import SGLangEngine
from mileage.testing.servers import start_servers

PROMPT = [1, 5, 6, 7]


@pytest.fixture(scope="module")
def server(tiny_hf):
    (proc,) = start_servers(tiny_hf, 1)
    yield proc
    proc.stop()


def generate(url, payload):
    return post_json(url + "/generate", payload, timeout=60)


def test_serve_says_its_dtype_and_keeps_it_across_weight_reloads(server, tiny_hf):
    from mileage.precision import precision_of
    from mileage.serve.server import EngineServer

    chosen, why = resolve("auto", torch.device("cpu"))
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[chosen]
    assert f"(--dtype {dtype}, {why})" in "".join(server.output)
    bf16 = EngineServer(str(tiny_hf), "bf16")
    assert precision_of(bf16.engine.model) == "bf16"
    assert bf16.update_weights({"model_path": str(tiny_hf)})["success"]
    assert precision_of(bf16.engine.model) == "bf16"
    # and it samples from fp32 logits after the reload too, unless told not to
    assert isinstance(bf16.engine.model.get_output_embeddings(), Fp32LogitsLinear)
    rounded = EngineServer(str(tiny_hf), "bf16", fp32_lm_head=False)
    # a plain head (the engine's `PackedLinear`): bf16 logits under autocast
    assert not isinstance(rounded.engine.model.get_output_embeddings(), Fp32LogitsLinear)
    assert precision_of(EngineServer(str(tiny_hf)).engine.model) == "fp32"


def test_health_and_model_info(server):
    with urllib.request.urlopen(server.url + "/health", timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(server.url + "/get_model_info", timeout=10) as reply:
        assert json.loads(reply.read())["weight_version"] == "default"


def test_generate_reply_has_sglangs_shape_and_the_local_engines_numbers(server, tiny_hf):
    seeds = [11, 12, 13]
    params = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0}
    reply = generate(
        server.url,
        {
            "input_ids": [PROMPT] * 3,
            "sampling_params": [{**params, "sampling_seed": s} for s in seeds],
            "return_logprob": True,
        },
    )
    assert isinstance(reply, list) and len(reply) == 3
    # the server computes in its --dtype, by default auto's choice for this CPU, and samples
    # from fp32 logits (its default; on an fp32 server it changes nothing)
    precision = resolve("auto", torch.device("cpu"))[0]
    model = set_precision(load_causal_lm(tiny_hf), precision, fp32_lm_head=True)
    local = LocalEngine(model, pad_id=0, eos_id=2).generate(
        [PROMPT] * 3,
        SamplingParams(6, 1.0, 1.0),
        [torch.Generator().manual_seed(s) for s in seeds],
    )
    for item, want in zip(reply, local, strict=True):
        meta = item["meta_info"]
        assert item["output_ids"] == want.response_ids
        assert [p[1] for p in meta["output_token_logprobs"]] == want.response_ids
        assert [p[0] for p in meta["output_token_logprobs"]] == want.logprobs
        assert meta["finish_reason"]["type"] == ("stop" if want.finished else "length")
        assert meta["completion_tokens"] == len(want.response_ids)
        assert meta["weight_version"] == "default"
    assert len({tuple(i["output_ids"]) for i in reply}) > 1  # distinct seeds, distinct samples


def test_a_rows_sample_is_drawn_from_its_own_seed(server):
    params = {"max_new_tokens": 6, "sampling_seed": 5}
    alone = generate(server.url, {"input_ids": PROMPT, "sampling_params": params})
    batched = generate(
        server.url,
        {
            "input_ids": [PROMPT, PROMPT],
            "sampling_params": [{"max_new_tokens": 6, "sampling_seed": 99}, params],
        },
    )
    assert isinstance(alone, dict)  # a single input gets a single reply, as in SGLang
    # the same draws whatever else is in the batch (log-probs may differ in the last bit: the
    # batch size changes the matmul blocking, so the client keeps request composition fixed)
    assert batched[1]["output_ids"] == alone["output_ids"]
    assert batched[0]["output_ids"] != alone["output_ids"]


@pytest.mark.parametrize(
    "payload",
    [
        {"text": "1+1="},
        {"input_ids": [[1, 2], [1]], "sampling_params": [{"sampling_seed": 1}, {}]},
        {"input_ids": [[1, 10**9]]},
        {"input_ids": [1, 2], "sampling_params": {"top_k": 5}},
    ],
)
def test_bad_requests_are_refused_with_400(server, payload):
    with pytest.raises(BadReply, match="HTTP 400"):
        generate(server.url, payload)


def test_client_syncs_weights_and_refuses_stale_versions(server, tiny_hf, tmp_path):
    engine = SGLangEngine([server.url], 64, timeout=30, attempts=2, sync_timeout=60,
                          weights_dir=str(tmp_path / "w"))  # fmt: skip
    model = load_causal_lm(tiny_hf)
    params = SamplingParams(4, 1.0, 1.0)
    seed = SamplingSeed(1234, 0)
    engine.update_weights(model, 3)
    before = engine.generate([PROMPT] * 4, params, seed, group_size=2)
    assert {c.weight_version for c in before} == {3}
    assert engine.generate([PROMPT] * 4, params, seed, group_size=2) == before
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    engine.update_weights(model, 4)
    after = engine.generate([PROMPT] * 4, params, seed, group_size=2)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    # the server now says another version than the trainer synced: not silently trained on
    post_json(
        server.url + "/update_weights_from_disk",
        {"model_path": str(engine.weights.path), "weight_version": "2"},
        timeout=60,
    )
    with pytest.raises(UserError, match="weight version 2, expected 4"):
        engine.generate([PROMPT] * 2, params, seed, group_size=2)
    refused = post_json(
        server.url + "/update_weights_from_disk", {"model_path": str(tmp_path)}, timeout=60
    )
    assert refused["success"] is False
    engine.close()
    assert not engine.weights.root.exists() or engine.weights.root == tmp_path / "w"


def test_server_info_answers_what_the_sglang_client_reads(server):
    from mileage.rollout.engines.http import get_json
    from mileage.rollout.engines.server_info import parse_server_info

    info = get_json(server.url + "/get_server_info", timeout=10)
    parsed = parse_server_info(server.url, info)
    assert (parsed.workers, parsed.dtype, parsed.deterministic) == (1, "float32", True)


def test_broadcast_in_buckets_loads_every_tensor_and_a_short_update_is_refused(server, tiny_hf):
    """Several calls of update_weights_from_distributed make one update: the server takes the
    version only with the last, and a last call that leaves tensors out is refused."""
    import torch.distributed as dist

    from mileage.checkpoint.tensors import model_tensors
    from mileage.rollout.engines.broadcast import update_request

    model = load_causal_lm(tiny_hf)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.75)
    total = sum(t.numel() * 4 for t in model_tensors(model).values())
    engine = SGLangEngine([server.url], 64, timeout=30, attempts=2, sync_timeout=60,
                          weights_dir=None, broadcast_from="127.0.0.1",
                          buffer_size=total // 3 + 1)  # fmt: skip
    try:
        engine.update_weights(model, 11)
        assert engine.broadcast.last_buckets >= 3
        seed, params = SamplingSeed(1234, 0), SamplingParams(4, 1.0, 1.0)
        served = engine.generate([PROMPT] * 2, params, seed, group_size=2)
        # the server computes in its default precision (auto): so does the engine it is held to
        set_precision(model, resolve("auto", torch.device("cpu"))[0], fp32_lm_head=True)
        local = LocalEngine(model, pad_id=0, eos_id=2).generate(
            [PROMPT] * 2, params, [torch.Generator().manual_seed(seed.row_seed(r)) for r in (0, 1)]
        )
        assert [c.response_ids for c in served] == [c.response_ids for c in local]
        assert [c.logprobs for c in served] == [c.logprobs for c in local]
        # a "last" bucket with one tensor, when nothing else of the update came: refused
        name, tensor = next(iter(model_tensors(model).items()))
        sender = engine.broadcast
        futures = sender._posts(
            "/update_weights_from_distributed",
            {server.url: update_request({name: tensor}, 12, last=True, group=sender.group_name)},
        )
        dist.broadcast(tensor.detach().contiguous(), src=0, group=sender.group)
        reply = futures[server.url].result(timeout=60)
        assert reply["success"] is False and "not sent" in reply["message"]
        with urllib.request.urlopen(server.url + "/get_model_info", timeout=10) as answer:
            assert json.loads(answer.read())["weight_version"] == "11"
    finally:
        engine.close()
