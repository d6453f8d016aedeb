"""Adapter-only weight sync of a LoRA run: `mileage serve --enable-lora` takes the adapter (from
a directory or inside the request) and generates with base + adapter exactly as the trainer's
local engine does; SGLang and vLLM clients send the adapter alone after the first sync, and an
engine that cannot take adapters gets merged weights, said once."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import builtin_train_args

from mileage.testing.crash import run_uninterrupted

pytest.importorskip("peft")

LORA = [
    "--lora-rank", "8",
    "--lora-alpha", "16",
    "--target-modules", "all-linear",
    "--lr", "2e-3",
]  # fmt: skip


def trained_like_policy(builtin_model: Path):
    """A LoRA policy on the built-in model whose adapter is not zero (lora_B drawn at random),
    so base and base + adapter generate differently."""
    from mileage.models.hf import load_causal_lm
    from mileage.models.lora import LoraConfig, adapter_tensors
    from mileage.training.lora import build_lora_policy

    cfg = LoraConfig(lora_rank=4, lora_alpha=8, target_modules="q_proj,v_proj,down_proj")
    policy = build_lora_policy(
        cfg,
        0,
        (str(builtin_model), "hf"),
        (str(builtin_model), "hf"),
        False,
        lambda path, fmt: load_causal_lm(path),
        lambda line: None,
    )
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in adapter_tensors(policy.model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    policy.model.eval()
    return policy


def generate(server, rows, lora_path=None) -> list[tuple[list[int], list[float]]]:
    body = {
        "input_ids": rows,
        "sampling_params": [
            {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 11 + i}
            for i in range(len(rows))
        ],
        "return_logprob": True,
    }
    if lora_path is not None:
        body["lora_path"] = lora_path
    out = server.generate(body)
    return [
        (o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in out
    ]


def local(model, tokenizer, rows) -> list[tuple[list[int], list[float]]]:
    from mileage.rollout.engine import LocalEngine, SamplingParams

    engine = LocalEngine(
        model, tokenizer.pad_token_id or tokenizer.eos_token_id, tokenizer.eos_token_id
    )
    gens = [torch.Generator().manual_seed(11 + i) for i in range(len(rows))]
    done = engine.generate(rows, SamplingParams(6, 1.0, 1.0), gens)
    return [(c.response_ids, c.logprobs) for c in done]


def as_base(generated, base) -> bool:
    """The base model's generation: the same tokens, log-probs within 1e-6. Once PEFT has been
    in the served model, its base log-probs may sit 1e-7 from the first ones on some hosts (an
    Intel Xeon with AMX; an AMD EPYC repeats them bit for bit) although its weights, their
    addresses, its config and the thread count are unchanged (not pinned down); an adapter left
    in moves them by far more."""
    if [ids for ids, _ in generated] != [ids for ids, _ in base]:
        return False
    pairs = [
        (a, b)
        for (_, x), (_, y) in zip(generated, base, strict=True)
        for a, b in zip(x, y, strict=True)
    ]
    return max(abs(a - b) for a, b in pairs) < 1e-6


def test_served_adapter_generates_exactly_as_the_trainers_local_engine(builtin_model, tmp_path):
    from peft import get_peft_model_state_dict

    from mileage.models.lora import save_adapter
    from mileage.rollout.engines.adapters import encode_tensors
    from mileage.serve.lora import TENSOR_FORMAT
    from mileage.serve.server import EngineServer

    policy = trained_like_policy(builtin_model)
    adapter_dir = tmp_path / "adapter"
    save_adapter(policy.peft_model, adapter_dir, policy.base)
    server = EngineServer(str(builtin_model), "fp32", enable_lora=True)
    rows = [[5, 6, 7], [8, 9, 10, 11]]
    base = generate(server, rows)

    reply = server.lora.load_from_disk({"lora_name": "v1", "lora_path": str(adapter_dir)})
    assert reply["success"], reply
    adapted = generate(server, rows, "v1")
    trainer = local(policy.model, server.tokenizer, rows)
    assert adapted == trainer  # tokens and log-probs, bit for bit
    assert adapted != base
    assert as_base(generate(server, rows), base)  # no lora_path: the base alone, as before

    # the same adapter inside the request
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = get_peft_model_state_dict(policy.peft_model)
    body = {"lora_name": "v2", "config_dict": config, "serialized_tensors": encode_tensors(tensors)}
    refused = server.lora.load_from_tensors(body)  # no load_format: SGLang's pickle, refused
    assert not refused["success"] and "pickle" in refused["error_message"]
    reply = server.lora.load_from_tensors({**body, "load_format": TENSOR_FORMAT})
    assert reply["success"], reply
    assert generate(server, rows, ["v2", "v2"]) == trainer

    # an adapter missing a tensor would generate from PEFT's random init: refused
    partial = {k: v for i, (k, v) in enumerate(tensors.items()) if i}
    reply = server.lora.load_from_tensors(
        {**body, "lora_name": "v3", "serialized_tensors": encode_tensors(partial),
         "load_format": TENSOR_FORMAT}
    )  # fmt: skip
    assert not reply["success"] and "missing" in reply["error_message"], reply
    assert not server.lora.load_from_disk({"lora_name": "v1", "lora_path": str(adapter_dir)})[
        "success"
    ]  # the name is taken

    assert server.lora.unload({"lora_name": "v1"})["success"]
    with pytest.raises(ValueError, match="no adapter named 'v1'"):
        generate(server, rows, "v1")
    with pytest.raises(ValueError, match="one adapter per request"):
        generate(server, rows, ["v2", None])
    assert server.lora.unload({"lora_name": "v2"})["success"]
    assert as_base(generate(server, rows), base)  # the last unload takes PEFT's layers out

    # a full weight update replaces the model: its adapters go with it
    assert server.lora.load_from_disk({"lora_name": "v4", "lora_path": str(adapter_dir)})["success"]
    assert server.update_weights({"model_path": str(builtin_model)})["success"]
    assert server.lora.adapters.loaded() == {}
    assert as_base(generate(server, rows), base)


def test_serve_without_enable_lora_refuses_adapters(builtin_model, tmp_path):
    from mileage.serve.server import EngineServer

    server = EngineServer(str(builtin_model), "fp32")
    assert server.server_info()["enable_lora"] is False
    reply = server.lora.load_from_disk({"lora_name": "a", "lora_path": str(tmp_path)})
    assert not reply["success"] and "--enable-lora" in reply["error_message"]


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as reply:
        return json.loads(reply.read())


@pytest.mark.parametrize("from_tensor", [False, True], ids=["disk", "tensor"])
def test_a_lora_run_syncs_the_adapter_alone_to_mileage_serve(builtin_model, tmp_path, from_tensor):
    """The base goes to the server once (the first sync); every later sync is the adapter alone,
    and the server samples with the trainer's weights (log-probs equal to float rounding)."""
    from mileage.testing.servers import start_servers

    (server,) = start_servers(builtin_model, 1, args=("--dtype", "float32", "--enable-lora"))
    try:
        save = tmp_path / "run"
        engine = ["--rollout-engine", "sglang", "--rollout-url", server.url, "--precision", "fp32"]
        extra = ["--lora-sync-from-tensor"] if from_tensor else []
        args = builtin_train_args("--num-rollout", "3", "--global-batch-size", "16")
        done = run_uninterrupted([*args, *LORA, *engine, *extra], save)
        model_info = get(server.url, "/get_model_info")
        loaded = post(server.url, "/unload_lora_adapter", {"lora_name": "nothing"})
    finally:
        server.stop()
    assert done.stdout.count("each update sends the adapter alone") == 1, done.stdout
    assert "merged weights" not in done.stdout
    # one full load (the first sync's base), then adapters: the last version, the only one left
    assert Path(model_info["model_path"]).name == "current"
    version = model_info["weight_version"]
    assert int(version) > 0
    assert list(loaded["loaded_adapters"]) == [f"mileage-lora-v{version}"]
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["rollout_id"] >= 0]
    assert records[-1]["global_step"] > 0
    assert all(0 <= r["logprob_abs_diff"] < 1e-5 for r in records), records


@pytest.mark.parametrize(
    ("info", "problem"),
    [
        ({}, "was started without --enable-lora"),
        ({"enable_lora": True, "max_lora_rank": 4}, "--max-lora-rank 4 < --lora-rank 8"),
        (
            {"enable_lora": True, "lora_target_modules": ["q_proj", "v_proj"]},
            "has no k_proj in its --lora-target-modules",
        ),
        ({"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"]}, None),
    ],
)
def test_sglang_servers_say_whether_they_take_the_adapter(info, problem):
    """What decides adapter-only against merged sync for SGLang: its /get_server_info."""
    from mileage.errors import UserError
    from mileage.rollout.engines.sglang import SGLangEngine
    from mileage.testing.servers import FakeSGLang

    fake = FakeSGLang(info)
    try:
        engine = SGLangEngine([fake.url], 50, 5.0, 1, 5.0, None)
        said = engine.adapter_problem(8, ["q_proj", "k_proj", "v_proj"], from_tensor=False)
        assert said is None if problem is None else problem in said, said
        if problem is None:  # SGLang takes no safetensors tensors: one line, not a fallback
            with pytest.raises(UserError, match="--lora-sync-from-tensor: .* is SGLang"):
                engine.adapter_problem(8, ["q_proj"], from_tensor=True)
        engine.close()
    finally:
        fake.stop()
