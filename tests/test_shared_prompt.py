"""The training forward runs each distinct prompt once per micro-batch
(`mileage.training.shared_prompt`): the same log-probs, entropies and gradients as one plain
forward of every row, from one prompt pass of the distinct prompts and one pass of the samples;
a plain forward wherever nothing can be shared."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from mileage.models.kv_cache import shareable_cache
from mileage.models.lora import LoraConfig, apply_lora
from mileage.precision import BF16, set_precision
from mileage.training.actor import sequence_logprobs
from mileage.training.batch import pack_samples
from mileage.training.shared_prompt import shared_prompt_logprobs

A, B, C = [1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13, 14, 15]


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    trained: bool = True  # False: the whole response is tool tokens (loss mask 0)

    reward: float = 1.0

    @property
    def logprobs(self) -> list[float]:
        return [0.0] * len(self.response_ids)

    def mask(self) -> list[float]:
        return [float(self.trained)] * len(self.response_ids)


# rows of (prompt, response): a GRPO rollout, and one with every awkward case at once:
# interleaved groups, prompts and responses of other lengths, an empty response, a row with
# no trained token, and a prompt seen once
GROUPS = [(p, [20 + i, 21, 22 + i][: 1 + i % 3]) for p in (A, B) for i in range(4)]
MIXED = [
    (A, [20, 21, 22, 23, 24]),
    (C, [25]),
    (A, [26, 27]),
    (B, []),
    (C, [28, 29, 30, 31, 32, 33]),
    (B, [34, 35, 36], False),
    (A, [37, 38, 39]),
    ([1, 40, 41], [42, 43]),
]


def _batch(rows):
    # ids inside the built-in tokenizer's 43 words
    samples = [
        Sample(prompt, [t % 40 for t in response], *rest) for prompt, response, *rest in rows
    ]
    packed = pack_samples(samples, pad_id=0)
    return packed.slice(0, len(samples)), samples


def _plain(batch):
    return dataclasses.replace(batch, prompt_lens=None)


def _response_columns(batch, samples) -> torch.Tensor:
    """1 at every target column holding a response token, in the batch's own columns."""
    mask = torch.zeros_like(batch.loss_mask)
    for row, s in enumerate(samples):
        first = len(s.prompt_ids) - 1 - batch.target_offset
        mask[row, first : first + len(s.response_ids)] = 1.0
    return mask


@pytest.fixture(scope="module")
def model(tiny_hf):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny_hf)
    for p in m.parameters():  # a random model's logits are near uniform: sharpen them
        p.data.mul_(3.0)
    return m


@pytest.fixture
def embedded(model):
    """The shape of every batch of ids the model embeds from now on."""
    shapes: list[tuple[int, ...]] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: shapes.append(tuple(args[0].shape))
    )
    yield shapes
    hook.remove()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    # fp32 sums in another order: entries near zero differ relatively, the tensor does not
    return float((got - want).norm() / want.norm())


def _logprobs_and_grads(model, batch, weights, chunk_tokens: int = -1):
    model.zero_grad(set_to_none=True)
    logp, entropy = sequence_logprobs(
        model, batch, 0.7, with_entropy=True, chunk_tokens=chunk_tokens
    )
    ((logp * weights).sum() + 0.3 * (entropy * weights).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("rows", [GROUPS, MIXED], ids=["grpo", "mixed"])
def test_same_logprobs_entropies_and_gradients_as_the_plain_forward(model, rows):
    batch, samples = _batch(rows)
    response = _response_columns(batch, samples)
    weights = torch.rand(response.shape, generator=torch.Generator().manual_seed(1)) * response
    shared = _logprobs_and_grads(model, batch, weights)
    plain = _logprobs_and_grads(model, _plain(batch), weights)
    for got, want in zip(shared[:2], plain[:2], strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got * response, want * response, rtol=0, atol=2e-5)
        assert torch.all(got[response == 0] == 0)  # prompt and padding columns
    assert len(shared[2]) == len(plain[2]) > 0
    for got, want in zip(shared[2], plain[2], strict=True):
        assert _relative_error(got, want) < 1e-5


def test_each_distinct_prompt_runs_once_then_each_sample_from_its_last_prompt_token(
    model, embedded
):
    batch, samples = _batch(MIXED)
    with torch.no_grad():
        assert shared_prompt_logprobs(model, batch, 1.0) is not None
    # 4 distinct prompts, the longest (C) 6 tokens less its last; each row's own part is its
    # prompt's last token plus its response but the last (6 tokens at most, for C's 6)
    assert embedded == [(4, len(C) - 1), (len(MIXED), 6)]


def test_the_actor_shares_and_the_reference_pass_too(model, embedded):
    batch, _ = _batch(GROUPS)
    with torch.no_grad():
        sequence_logprobs(model, batch, 1.0)
    assert embedded[0] == (2, len(A) - 1)  # the two prompts once each, then the samples
    assert len(embedded) == 2


@pytest.mark.parametrize(
    "case", ["all prompts distinct", "prompt lengths unknown", "a one-token prompt"]
)
def test_nothing_to_share_is_one_plain_forward(model, embedded, case):
    rows = {
        "all prompts distinct": [(A, [20, 21]), (B, [22]), (C, [23, 24])],
        "prompt lengths unknown": GROUPS,
        "a one-token prompt": GROUPS + [([1], [20, 21])],
    }[case]
    batch, samples = _batch(rows)
    if case == "prompt lengths unknown":
        batch = _plain(batch)
    with torch.no_grad():
        assert shared_prompt_logprobs(model, batch, 1.0) is None
        sequence_logprobs(model, batch, 1.0)
    assert embedded == [tuple(batch.input_ids.shape)]


def test_a_cache_that_cannot_be_copied_means_no_sharing():
    sliding = MistralConfig(num_hidden_layers=2, sliding_window=4)
    assert shareable_cache(sliding) is None
    assert shareable_cache(MistralConfig(num_hidden_layers=2, sliding_window=None)) is not None


def test_a_lora_model_shares_through_peft(tiny_hf):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_hf)
    peft_model, _ = apply_lora(
        base, LoraConfig(lora_rank=4, target_modules="q_proj,v_proj"), seed=3
    )
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # a trained adapter, not the zero one LoRA starts from
            p.data.normal_(0.0, 0.5)
    batch, samples = _batch(GROUPS)
    response = _response_columns(batch, samples)
    shapes: list[tuple[int, ...]] = []
    base.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: shapes.append(tuple(args[0].shape))
    )
    shared = _logprobs_and_grads(peft_model, batch, response)
    assert shapes[0] == (2, len(A) - 1)
    plain = _logprobs_and_grads(peft_model, _plain(batch), response)
    torch.testing.assert_close(shared[0] * response, plain[0] * response, rtol=0, atol=2e-5)
    assert len(shared[2]) == len(plain[2]) == 8  # A and B of q_proj and v_proj, 2 layers
    for got, want in zip(shared[2], plain[2], strict=True):
        assert _relative_error(got, want) < 1e-5


def test_bf16_runs_both_passes_under_autocast(tiny_hf):
    torch.manual_seed(0)
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_hf)
    set_precision(bf16, BF16)
    dtypes: list[torch.dtype] = []
    bf16.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda _m, _args, out: dtypes.append(out.dtype)
    )
    batch, _ = _batch(GROUPS)
    with torch.no_grad():
        logp, _ = shared_prompt_logprobs(bf16, batch, 1.0)
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    assert logp.dtype == torch.float32  # the log-softmax is fp32


def test_sharded_parameters_mean_one_plain_forward(tiny_hf):
    """FSDP2 frees a module's gathered weights after its first backward, and a second pass's
    backward through it would read freed memory: sharded models never share."""

    class Sharded(torch.Tensor):  # stands in for FSDP2's DTensor: a tensor subclass
        pass

    sharded = AutoModelForCausalLM.from_pretrained(tiny_hf)
    layer = sharded.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(torch.Tensor._make_subclass(Sharded, layer.weight))
    batch, _ = _batch(GROUPS)
    with torch.no_grad():
        assert shared_prompt_logprobs(sharded, batch, 1.0) is None


@pytest.mark.parametrize(
    ("shared", "chunk_tokens"),
    [(True, -1), (False, 4)],
    ids=["shared-prompt", "plain-forward-chunked-head"],
)
def test_bf16_gradients_do_not_depend_on_autocast_in_other_threads(tiny_hf, shared, chunk_tokens):
    """train-async generates in a thread beside training. autocast empties its cast cache when
    any thread leaves its last context, so a weight cast once and shared by several uses (their
    gradients summed in bf16) or cast again per use depended on the other thread: gradients
    changed from step to step. Each shared-prompt pass casts for itself; the chunked LM head is
    one autograd node (`mileage.training.logprobs.ChunkedHead`)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    set_precision(model, BF16)
    beside = copy.deepcopy(model).eval()
    batch, samples = _batch(GROUPS)
    batch = batch if shared else _plain(batch)
    weights = _response_columns(batch, samples)
    stop = threading.Event()

    def generate_beside() -> None:
        ids = torch.randint(3, 40, (1, 2))  # short contexts: many exits
        while not stop.is_set():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                beside(input_ids=ids)

    thread = threading.Thread(target=generate_beside, daemon=True)
    thread.start()
    try:
        grads = {
            tuple(
                float(g.double().sum())
                for g in _logprobs_and_grads(model, batch, weights, chunk_tokens)[2]
            )
            for _ in range(50)
        }
    finally:
        stop.set()
        thread.join(timeout=60)
    assert len(grads) == 1
