"""The SGLang client against real SGLang's behaviour, without SGLang: 31-bit row seeds, the
seed check of `/get_server_info` (`--enable-deterministic-inference`), broadcast sync in
buckets of `--update-weight-buffer-size` bytes in the servers' dtype with one rank per worker
(tp * pp * dp), and many requests in flight per server with the same samples at any count.
Servers are `FakeSGLang` (mileage/testing/servers.py) or `mileage serve`."""

from __future__ import annotations

import pytest
import torch
from conftest import fast_train_args

from mileage.cli.main import main
from mileage.errors import UserError
from mileage.rollout.engine import SamplingParams
from mileage.rollout.engines import broadcast as bc
from mileage.rollout.engines.base import SamplingSeed
from mileage.rollout.engines.http import BadReply
from mileage.rollout.engines.server_info import parse_server_info, serving_dtype
from mileage.rollout.engines.sglang import SGLangEngine
from mileage.seeding import derive_seed
from mileage.testing.servers import FakeSGLang


@pytest.fixture
def fakes():
    started: list[FakeSGLang] = []

    def start(**kw) -> FakeSGLang:
        started.append(FakeSGLang(**kw))
        return started[-1]

    yield start
    for fake in started:
        fake.stop()


def engine_on(urls, **kw) -> SGLangEngine:
    kw.setdefault("log", lambda line: None)
    return SGLangEngine(list(urls), 50, 30.0, 2, 30.0, None, **kw)


# --- seeds ---------------------------------------------------------------------------------


def test_row_seeds_fit_31_bits_and_stay_keyed_on_seed_rollout_and_row():
    seeds = [SamplingSeed(seed, rollout).row_seed(row)
             for seed in (0, 1234) for rollout in range(5) for row in range(64)]  # fmt: skip
    assert all(0 <= s < 2**31 for s in seeds)
    assert max(seeds) >= 2**30  # the full 31 bits are used, not a narrower range
    # the 63-bit derivation, masked: the same key gives the same seed, whatever else ran
    assert SamplingSeed(1234, 3).row_seed(5) == derive_seed(1234, "rollout/3/sample", 5) & (
        2**31 - 1
    )


# --- /get_server_info ----------------------------------------------------------------------


def test_server_info_counts_every_worker_and_reads_dtype_and_determinism():
    info = parse_server_info("u", {"tp_size": 2, "pp_size": 3, "dp_size": 2, "dtype": "bfloat16",
                                   "enable_deterministic_inference": True})  # fmt: skip
    assert (info.workers, info.dtype, info.deterministic) == (12, "bfloat16", True)
    bare = parse_server_info("u", {"tp_size": 1})  # an older server: no pp/dp, no flag
    assert (bare.workers, bare.dtype, bare.deterministic) == (1, "auto", False)
    for bad in ({"tp_size": 0}, {"dp_size": "2"}, {"pp_size": True}, []):
        with pytest.raises(BadReply):
            parse_server_info("u", bad)


@pytest.mark.parametrize(
    ("reported", "config", "model_type", "expected"),
    [
        ("bfloat16", torch.float32, "llama", torch.bfloat16),
        ("float32", torch.bfloat16, "llama", torch.float32),
        ("half", None, "llama", torch.float16),
        ("auto", torch.bfloat16, "llama", torch.bfloat16),
        ("auto", "bfloat16", "llama", torch.bfloat16),
        ("auto", torch.float32, "llama", torch.float16),  # SGLang serves fp32 models in fp16
        ("auto", torch.float32, "gemma2", torch.bfloat16),
        ("auto", None, "llama", torch.float16),
    ],
)
def test_the_servers_dtype(reported, config, model_type, expected):
    assert serving_dtype(reported, config, model_type) == expected


def test_an_unknown_server_dtype_is_one_line():
    with pytest.raises(UserError, match="dtype 'fp8' is not one mileage can cast to"):
        serving_dtype("fp8", torch.float32)


def test_a_server_that_ignores_seeds_stops_the_run(fakes):
    honest, careless = fakes(), fakes(info={"enable_deterministic_inference": False})
    with pytest.raises(UserError, match="--enable-deterministic-inference") as refused:
        engine_on([honest.url, careless.url])._check_reachable()
    assert careless.url in str(refused.value) and honest.url not in str(refused.value)
    assert "--allow-nondeterministic-rollout" in str(refused.value)
    lines: list[str] = []
    allowed = engine_on([honest.url, careless.url], allow_nondeterministic=True, log=lines.append)
    assert allowed._check_reachable() == {}
    assert len(lines) == 1 and "resume is not sample-exact" in lines[0]
    allowed._check_reachable()  # checked once per server, not at every sync
    assert len(lines) == 1


def test_an_unreachable_server_counts_as_failed_and_is_checked_again(fakes):
    honest = fakes()
    engine = engine_on([honest.url, "http://127.0.0.1:9"])
    unreachable = engine._check_reachable()
    assert list(unreachable) == ["http://127.0.0.1:9"]
    assert engine.checked == {honest.url}


def test_a_server_left_out_of_generation_is_named_once_and_when_it_is_back(fakes, monkeypatch):
    honest, dead = fakes(), "http://127.0.0.1:9"
    lines: list[str] = []
    engine = engine_on([honest.url, dead], log=lines.append)
    engine.load_weights_from("/weights", 1)
    engine.load_weights_from("/weights", 2)
    assert engine.pool.excluded == {dead}
    assert lines == [
        f"sglang rollout: {dead} is left out of generation until a weight sync reaches it "
        f"({dead}/get_server_info: [Errno 111] Connection refused)"
    ]
    # the server answers again: the next sync reaches it, and the log says so
    monkeypatch.setattr(engine.pool, "broadcast", lambda *a, **k: dict.fromkeys(engine.pool.urls))
    monkeypatch.setattr(engine, "_check_reachable", lambda: {})
    engine.load_weights_from("/weights", 3)
    assert engine.pool.excluded == set()
    assert lines[-1] == f"sglang rollout: {dead} is back (it loaded weight version 3)"


def test_train_refuses_a_server_without_deterministic_inference(fakes, tiny_hf, capsys):
    careless = fakes(info={"enable_deterministic_inference": False})
    args = ["--rollout-engine", "sglang", "--rollout-url", careless.url, "--num-rollout", "1"]
    code = main(["train", *fast_train_args(tiny_hf, *args)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "started without --enable-deterministic-inference" in err


def test_the_plan_says_resume_is_not_sample_exact(tiny_hf, capsys, mileage_home):
    args = ["--rollout-engine", "sglang", "--rollout-url", "http://127.0.0.1:9"]
    assert main(["plan", *fast_train_args(tiny_hf, *args, "--allow-nondeterministic-rollout")]) == 0
    assert "resume is not sample-exact" in capsys.readouterr().out
    assert main(["plan", *fast_train_args(tiny_hf, *args)]) == 0
    assert "sample-exact" not in capsys.readouterr().out


# --- broadcast: buckets, dtype, ranks ------------------------------------------------------


def test_buckets_hold_at_most_the_buffer_size_in_order():
    sizes = {"a": 40, "b": 30, "c": 30, "d": 100, "e": 10, "f": 60}
    assert bc.plan_buckets(sizes, 100) == [["a", "b", "c"], ["d"], ["e", "f"]]
    assert bc.plan_buckets(sizes, 10**9) == [list(sizes)]
    # a tensor larger than the buffer goes alone; nothing is dropped or reordered
    assert bc.plan_buckets(sizes, 35) == [["a"], ["b"], ["c"], ["d"], ["e"], ["f"]]


def test_only_the_last_bucket_labels_the_version_and_flushes():
    t = {"w": torch.zeros(2, 3, dtype=torch.bfloat16)}
    first, last = bc.update_request(t, 7, last=False), bc.update_request(t, 7, last=True)
    assert "weight_version" not in first and first["flush_cache"] is False
    assert last["weight_version"] == "7" and last["flush_cache"] is True
    assert last["dtypes"] == ["bfloat16"] and last["shapes"] == [[2, 3]]


class Done:
    def result(self, timeout=None):
        return {"success": True}


def recording_sender(monkeypatch, buffer_size: int, dtype: torch.dtype):
    """A BroadcastWeights whose group is formed and whose posts and broadcasts are recorded."""
    sent: list[torch.Tensor] = []
    requests: list[dict] = []
    pool = engine_on(["http://a", "http://b"]).pool
    sender = bc.BroadcastWeights(pool, 5.0, "127.0.0.1", buffer_size)
    sender.group, sender.dtype = object(), dtype
    monkeypatch.setattr(bc.dist, "broadcast", lambda t, src, group: sent.append(t.clone()))

    def posts(path, payloads):
        assert (
            path == "/update_weights_from_distributed" and len(set(map(id, payloads.values()))) == 1
        )
        requests.append(next(iter(payloads.values())))
        return {url: Done() for url in payloads}

    monkeypatch.setattr(sender, "_posts", posts)
    return sender, sent, requests


def test_send_casts_to_the_servers_dtype_in_buckets(monkeypatch, tiny_hf):
    from mileage.checkpoint.tensors import model_tensors
    from mileage.models.hf import load_causal_lm

    model = load_causal_lm(tiny_hf)
    tensors = model_tensors(model)
    total = sum(t.numel() * 2 for t in tensors.values())  # bytes in bf16
    sender, sent, requests = recording_sender(monkeypatch, total // 3, torch.bfloat16)
    sender.send(model, 4)
    assert sender.last_buckets == len(requests) >= 3
    names = [n for r in requests for n in r["names"]]
    assert names == list(tensors)  # every tensor once, in order
    for request in requests:
        assert set(request["dtypes"]) == {"bfloat16"}
        size = sum(torch.Size(s).numel() * 2 for s in request["shapes"])
        assert size <= total // 3 or len(request["names"]) == 1
    assert [r.get("weight_version") for r in requests] == [None] * (len(requests) - 1) + ["4"]
    assert all(t.dtype == torch.bfloat16 for t in sent)
    for name, value in zip(names, sent, strict=True):
        assert torch.equal(value, tensors[name].detach().to(torch.bfloat16))


def test_the_group_has_one_rank_per_server_worker(monkeypatch, fakes, tiny_hf):
    from mileage.models.hf import load_causal_lm

    wide = fakes(info={"tp_size": 2, "pp_size": 1, "dp_size": 2, "dtype": "float32"})
    narrow = fakes(info={"dtype": "float32"})
    sender = bc.BroadcastWeights(engine_on([wide.url, narrow.url]).pool, 5.0, "127.0.0.1")
    payloads: dict = {}
    monkeypatch.setattr(sender, "_posts", lambda path, p: payloads.update(p) or {})
    monkeypatch.setattr(bc, "join_group", lambda *a: ("group", a))
    sender.connect(load_causal_lm(tiny_hf))
    assert payloads[wide.url]["world_size"] == payloads[narrow.url]["world_size"] == 1 + 4 + 1
    assert (payloads[wide.url]["rank_offset"], payloads[narrow.url]["rank_offset"]) == (1, 5)
    assert sender.group[1][3] == 6 and sender.dtype == torch.float32  # the trainer's world size


def test_servers_with_different_dtypes_are_refused(fakes, tiny_hf):
    from mileage.models.hf import load_causal_lm

    a, b = fakes(info={"dtype": "bfloat16"}), fakes(info={"dtype": "float16"})
    sender = bc.BroadcastWeights(engine_on([a.url, b.url]).pool, 5.0, "127.0.0.1")
    with pytest.raises(UserError, match="different dtypes"):
        sender.connect(load_causal_lm(tiny_hf))


# --- requests in flight --------------------------------------------------------------------


def test_many_requests_in_flight_give_the_same_samples_in_order(fakes):
    servers = [fakes(latency=0.02), fakes(latency=0.02)]
    prompts = [[1 + (i % 7), 2, 3] for i in range(64)]
    params, seed = SamplingParams(5, 1.0, 1.0), SamplingSeed(1234, 3)
    results = {}
    for concurrency in (1, 16):
        engine = engine_on([s.url for s in servers], concurrency=concurrency)
        for server in servers:
            server.weight_version, server.max_in_flight = "3", 0
        engine.weight_version = 3
        results[concurrency] = engine.generate(prompts, params, seed, group_size=4)
        in_flight = max(s.max_in_flight for s in servers)
        assert in_flight == 1 if concurrency == 1 else in_flight > 1
    assert results[1] == results[16]
    assert [c.prompt_ids for c in results[16]] == prompts  # submission order
    # each group's samples differ from each other (one seed per row, not per request)
    assert len({tuple(c.response_ids) for c in results[16][:4]}) == 4


# --- under torchrun ------------------------------------------------------------------------


@pytest.mark.parametrize("sync", ["disk", "broadcast"])
def test_torchrun_takes_sglang_with_either_weight_sync(monkeypatch, sync):
    from mileage.cli.main import build_parser
    from mileage.run_config import RunConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["train", "--rollout-engine", "sglang", "--rollout-url", "http://127.0.0.1:9",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-weight-sync", sync]  # fmt: skip
    cfg = RunConfig.from_args(build_parser().parse_args(args))
    assert cfg.engine.rollout_weight_sync == sync


@pytest.mark.parametrize(
    "flags",
    [["--rollout-engine", "vllm"], ["--advantage-estimator", "ppo"], ["--async-save"]],
)
def test_torchrun_takes_vllm_ppo_and_async_save(monkeypatch, flags):
    """Refused under torchrun before; run at N=2 by test_engines_vllm.py,
    test_distributed_ppo.py and test_distributed_async_save.py."""
    from mileage.cli.main import build_parser
    from mileage.run_config import RunConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    parsed = build_parser().parse_args(["train", *flags, "--global-batch-size", "64"])
    cfg = RunConfig.from_args(parsed)
    assert cfg.parallel is not None


@pytest.mark.parametrize("flag", ["--update-weight-buffer-size", "--sglang-server-concurrency"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_new_counts_must_be_positive(flag, value, tiny_hf, capsys, mileage_home):
    args = ["--rollout-engine", "sglang", "--rollout-url", "http://127.0.0.1:9", flag, value]
    code = main(["train", *fast_train_args(tiny_hf, *args, "--num-rollout", "1")])
    err = capsys.readouterr().err
    assert code == 2 and err == f"mileage: error: {flag} must be positive, got {value}\n"
