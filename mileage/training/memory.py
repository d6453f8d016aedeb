"""Memory as a budget: what a training step will need, per rank, before it runs; the micro-batch
chosen from it; and the peak each rollout measured, logged beside the estimate.

The estimate counts, in bytes per rank:
- the runtime (Python, torch, transformers: `RUNTIME_BYTES`, measured, CPU only: a GPU's
  context is outside `torch.cuda.mem_get_info`'s free memory before the run allocates);
- the fp32 master weights, their gradients and AdamW's two moments (sharded over the ranks
  under FSDP2, plus one decoder layer gathered whole), and a reference model or a critic;
- the activations autograd keeps for a micro-batch (with `--gradient-checkpointing`,
  `ACT_CHECKPOINTED` x hidden values per token and layer, measured): per token and decoder layer
  `ACT_HIDDEN` x hidden + `ACT_INTERMEDIATE` x intermediate values (the norms, projections,
  rotary and MLP products of a Llama layer: 14.7k fp32 values on SmolLM2, measured 1.68 MiB per
  token over its 30 layers), `BF16_ACTIVATIONS` of that under bf16 autocast (the residual
  stream and norms stay fp32);
- the LM head's logits for one chunk of `--log-probs-chunk-size` tokens, `LOGIT_COPIES` fp32
  copies of them (logits, the upcast, the softmax and the gradient in the backward);
- the in-process engine: one generation batch's KV cache and, on a CPU in fp32, the weights
  reordered for oneDNN (`mileage.models.packed`).

Generation and training do not overlap in `train` (gradients are released before the next
rollout generates), so the peak is the larger phase; `train-async` generates beside training
and holds both. The measured peaks this was checked against are in docs/benchmarks.md
("Memory"); `mem_estimate_gib` is logged beside `mem_peak_gib` in metrics.jsonl so any run
checks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mileage.errors import UserError
from mileage.rollout.sizes import kv_cache_bytes
from mileage.training.memory_use import GiB

RUNTIME_BYTES = 400 << 20  # RSS of a `mileage train` process before its model is built (CPU)
# measured with autograd's MLP; the policy's gated MLP (mileage.models.gated_mlp) keeps one
# intermediate value fewer, so the estimate now errs high by that (SmolLM2: 1,536 of the 14,592
# values it counts per token and layer)
ACT_HIDDEN, ACT_INTERMEDIATE = 12, 5
# with each decoder layer checkpointed, what the peak still grows by per token and layer, in
# hidden-sized values: measured on SmolLM2 in fp32 (bench/train_pass.py, 8 and 16 rows of 571
# tokens: 0.69 MB per token against 1.51 MB without). Autograd keeps only each layer's input
# (1 value of 10); the rest is the backward's transient buffers and the memory the allocator keeps
ACT_CHECKPOINTED = 10
BF16_ACTIVATIONS = 0.78  # SmolLM2: 1.31 MiB per token in bf16 against 1.68 in fp32
# fp32 logit-sized buffers alive at once: the head's output (kept for the backward), its
# gradient, and a block's working copies; SmolLM2's unchunked pass of 16 x 129 positions took
# 1.0 GiB more than the chunked one, 2.5 copies of its 0.41 GB logits
LOGIT_COPIES = 3
MIN_ACTIVATION_BYTES = 1 << 30  # what a chosen micro-batch may always use, where it is free
FP32 = 4


@dataclass(frozen=True)
class ModelSize:
    """The counts the estimate needs, from a model's config alone (no weights are read)."""

    params: int  # every parameter once (a tied head is the embedding)
    linear_params: int  # those in linear layers (what the engine reorders)
    layer_params: int  # the largest decoder layer's (FSDP2 gathers one at a time)
    trainable: int  # what the optimizer updates (with LoRA: the adapter)
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_width: int  # key (or value) values per token and layer: kv heads x head dim


def model_size(config: Mapping, lora_rank: int = 0, lora_targets: str | None = None) -> ModelSize:
    """`ModelSize` of the model `config` (a config.json dict) describes: built on the meta device,
    so nothing is allocated. With a LoRA rank, the trainable count is the adapter's."""
    import transformers

    fields = dict(config)
    model_type = fields.pop("model_type", None) or "llama"
    hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    params = sum(p.numel() for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    decoder = max(layers, key=len) if layers else []
    trainable = params
    if lora_rank:
        from mileage.models.lora import LoraConfig, adaptable_linear_names, resolve_targets

        cfg = LoraConfig(lora_rank=lora_rank, target_modules=lora_targets or "all-linear")
        names = resolve_targets(model, cfg)
        modules = dict(model.named_modules())
        trainable = sum(
            lora_rank * (modules[full].in_features + modules[full].out_features)
            for full in adaptable_linear_names(model)
            if full.rpartition(".")[2] in names
        )
    return ModelSize(
        params=params,
        linear_params=sum(m.weight.numel() for m in linears),
        layer_params=max((sum(p.numel() for p in m.parameters()) for m in decoder), default=0),
        trainable=trainable,
        hidden=int(hf_config.hidden_size),
        intermediate=int(getattr(hf_config, "intermediate_size", 4 * hf_config.hidden_size)),
        layers=int(hf_config.num_hidden_layers),
        vocab=int(hf_config.vocab_size),
        kv_width=kv_cache_bytes(hf_config.to_dict(), 1, 1, 1) // (2 * hf_config.num_hidden_layers),
    )


@dataclass(frozen=True)
class Workload:
    """What one rollout's training asks of a rank."""

    samples: int  # this rank's samples per global batch (what micro-batches split)
    prompt_tokens: int  # the longest prompt
    response_tokens: int  # --rollout-max-response-len
    engine_rows: int  # one generation batch of the in-process engine (0: a remote engine)
    bf16: bool
    chunk_tokens: int  # --log-probs-chunk-size (-1: a micro-batch's logits at once)
    world_size: int = 1
    reference: bool = False
    teacher_params: int = 0  # --use-opd: the frozen teacher's parameters
    critic: bool = False
    overlapped: bool = False  # train-async: generation runs beside training
    cuda: bool = False
    group: int = 1  # samples per prompt: consecutive rows that share one
    shared_prompts: bool = True  # each distinct prompt's forward runs once (not under FSDP2)
    activation_checkpointing: bool = False  # --gradient-checkpointing
    max_tokens: int | None = None  # --use-dynamic-batch-size: a packed micro-batch's tokens
    offload: bool = False  # --fsdp-cpu-offload: shards, gradients, optimizer state on the host

    @property
    def tokens_per_sample(self) -> int:
        return self.prompt_tokens + self.response_tokens

    def pass_of(self, micro_batch: int) -> tuple[int, int]:
        """(tokens run, logit rows) of the largest training forward of `micro_batch` samples at
        their longest: the prompt once per distinct prompt when the forward shares them, and
        logits for the response positions only (`logits_to_keep`). Packed micro-batches
        (--max-tokens-per-gpu) run at most their budget, whatever `micro_batch`."""
        if self.max_tokens is not None:
            return self.max_tokens, self.max_tokens
        if self.shared_prompts and self.group > 1:
            prompts = -(-micro_batch // self.group) + (micro_batch % self.group != 0)
            tokens = prompts * self.prompt_tokens + micro_batch * (self.response_tokens + 1)
        else:
            tokens = micro_batch * self.tokens_per_sample
        return tokens, micro_batch * (self.response_tokens + 1)


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict[str, int]  # bytes by part (see the module's docstring)
    peak: int
    pass_tokens: int  # tokens of the largest training forward (a micro-batch)
    logit_rows: int  # positions it scores (at most one chunk's, when chunked)
    per_token: int  # activation bytes per token


def estimate(size: ModelSize, work: Workload, pass_tokens: int, logit_rows: int) -> MemoryEstimate:
    """The per-rank peak of a step whose largest training forward runs `pass_tokens` tokens
    and scores `logit_rows` of them."""
    n = max(work.world_size, 1)
    gathered = size.layer_params * FP32 if n > 1 else 0
    # with offload the device holds one gathered layer and its gradient, never the shards
    sharded = 0 if work.offload else 1
    state = sharded * size.params * FP32 // n + gathered
    if work.activation_checkpointing:  # --gradient-checkpointing
        per_token = size.layers * ACT_CHECKPOINTED * size.hidden * FP32
    else:
        per_token = size.layers * (ACT_HIDDEN * size.hidden + ACT_INTERMEDIATE * size.intermediate)
        per_token *= FP32
    if work.bf16:
        per_token = int(per_token * BF16_ACTIVATIONS)
    tokens = pass_tokens
    if work.chunk_tokens >= 0:
        logit_rows = min(logit_rows, work.chunk_tokens)
    engine = 0
    if work.engine_rows:
        kv = 2 * size.layers * size.kv_width * work.engine_rows * work.tokens_per_sample * FP32
        reordered = size.linear_params * FP32 if not (work.bf16 or work.cuda) else 0
        engine = kv + reordered + work.engine_rows * size.vocab * FP32
    parts = {
        "runtime": 0 if work.cuda else RUNTIME_BYTES,
        "weights": state,
        "gradients": gathered if work.offload else size.trainable * FP32 // n,
        "optimizer": sharded * 2 * size.trainable * FP32 // n,
        "reference": sharded * size.params * FP32 // n if work.reference else 0,
        "teacher": sharded * work.teacher_params * FP32 // n,
        "critic": sharded * (size.params + 3 * size.trainable) * FP32 // n if work.critic else 0,
        "activations": tokens * per_token,
        "logits": logit_rows * size.vocab * FP32 * LOGIT_COPIES,
        "engine": engine,
    }
    fixed = ("runtime", "weights", "optimizer", "reference", "teacher", "critic")
    always = sum(parts[k] for k in fixed)
    training = parts["gradients"] + parts["activations"] + parts["logits"]
    peak = always + (training + engine if work.overlapped else max(training, engine))
    return MemoryEstimate(parts, peak, pass_tokens, logit_rows, per_token)


def choose_micro_batch(size: ModelSize, work: Workload, available: int | None) -> int:
    """The micro-batch (samples) a run uses when neither `--micro-batch-size` nor a token
    budget is given: activations and logits of at most the model state's own size (weights,
    gradients, optimizer) or `MIN_ACTIVATION_BYTES`, whichever is more, less where the memory
    free is less; a divisor of the rank's samples per global batch.

    On a CPU larger passes do not run faster per token (docs/benchmarks.md, "Memory"): bounding
    them by the state keeps the peak a small multiple of what training must hold anyway, and
    a small model's whole batch (the built-in demo's: 0.1 GiB) stays one pass. On a
    GPU half of what is free after the fixed parts may go to activations: larger passes keep
    the device busy. At least one sample, even where none fits (`check_fits` then refuses)."""
    one = estimate(size, work, *work.pass_of(1))
    fixed = one.peak - one.parts["activations"] - one.parts["logits"]
    state = one.parts["weights"] + one.parts["gradients"] + one.parts["optimizer"]
    if work.cuda and available is not None:
        budget = max(available - fixed, 0) // 2
    else:
        budget = max(state, MIN_ACTIVATION_BYTES)
        if available is not None:
            budget = min(budget, available - fixed)
    return max(
        (m for m in _divisors(work.samples) if _pass_bytes(size, work, m) <= budget), default=1
    )


def _divisors(samples: int) -> list[int]:
    """The micro-batches that cut a rank's share of a global batch evenly (mileage requires it)."""
    return [m for m in range(1, samples + 1) if samples % m == 0]


def _pass_bytes(size: ModelSize, work: Workload, micro_batch: int) -> int:
    parts = estimate(size, work, *work.pass_of(micro_batch)).parts
    return parts["activations"] + parts["logits"]


def largest_fitting(size: ModelSize, work: Workload, available: int) -> int:
    """The largest micro-batch whose estimate fits `available` (0: not even one sample)."""
    fits = [m for m in _divisors(work.samples) if _peak(size, work, m) <= available]
    return max(fits, default=0)


def _peak(size: ModelSize, work: Workload, micro_batch: int) -> int:
    return estimate(size, work, *work.pass_of(micro_batch)).peak


@dataclass(frozen=True)
class MemoryPlan:
    """The micro-batch a run trains with, and the memory it is expected to take."""

    size: ModelSize
    work: Workload
    micro_batch: int
    # "given" (--micro-batch-size), "chosen" (fresh start), "saved" (a resume) or "tokens"
    # (--max-tokens-per-gpu: micro-batches by tokens)
    how: str
    available: int | None
    estimate: MemoryEstimate

    def describe(self) -> str:
        """The plan's line: the peak, what it is made of, and what is free."""
        e = self.estimate
        shown = ", ".join(f"{name} {_gib(b)}" for name, b in e.parts.items() if b)
        free = f" of {_gib(self.available)} free" if self.available is not None else ""
        how = {
            "given": "--micro-batch-size",
            "chosen": "chosen from the memory free; saved with the run",
            "saved": "as the run chose at its start (saved in its checkpoint)",
            "tokens": "",
        }[self.how]
        chunk = self.work.chunk_tokens
        if chunk < 0:
            logits = "the LM head on a whole forward at once (--log-probs-chunk-size -1)"
        elif chunk >= self.work.pass_of(self.micro_batch)[1]:
            logits = f"the LM head in chunks of {chunk} tokens: one per forward"
        else:
            logits = f"the LM head and log-probs in chunks of {chunk} tokens"
        if self.work.max_tokens is not None:
            batches = (
                f"micro-batches of up to {self.work.max_tokens} tokens, each packed into one row "
                f"(--max-tokens-per-gpu; a sample up to {self.work.tokens_per_sample})"
            )
        else:
            batches = (
                f"micro-batch {self.micro_batch} samples ({how}) of up to "
                f"{self.work.tokens_per_sample} tokens"
            )
        return (
            f"memory: peak ~{_gib(e.peak)}{free} per rank ({shown}); {batches}; "
            + logits
            + (
                "; decoder layers recomputed in the backward"
                if self.work.activation_checkpointing
                else ""
            )
            + (
                "; shards, gradients and optimizer state in host memory (--fsdp-cpu-offload)"
                if self.work.offload
                else ""
            )
        )

    def to_dict(self) -> dict:
        return {
            "peak": self.estimate.peak,
            "parts": self.estimate.parts,
            "available": self.available,
            "micro_batch": self.micro_batch,
            "micro_batch_from": self.how,
            "max_tokens_per_gpu": self.work.max_tokens,
            "tokens_per_sample": self.work.tokens_per_sample,
            "activation_bytes_per_token": self.estimate.per_token,
            "log_probs_chunk_size": self.work.chunk_tokens,
            "activation_checkpointing": self.work.activation_checkpointing,
            "offload": self.work.offload,
        }

    def rollout_estimate(self, pass_tokens: int, logit_rows: int) -> int:
        """The peak expected of a rollout whose largest training forward ran `pass_tokens`
        tokens and scored `logit_rows` (as measured; 0: the plan's worst case)."""
        if not pass_tokens:
            pass_tokens, logit_rows = self.work.pass_of(self.micro_batch)
        return estimate(self.size, self.work, pass_tokens, logit_rows).peak


def plan_memory(
    size: ModelSize,
    work: Workload,
    given: int | None,
    saved: int | None,
    available: int | None,
) -> MemoryPlan:
    """The micro-batch: `given` (--micro-batch-size), else `saved` (what a resumed run chose at
    its start: the same micro-batches keep it bit-exact), else chosen from `available`. A
    micro-batch whose estimate exceeds `available` is refused here, before anything runs."""
    if work.max_tokens is not None:
        return _plan_tokens(size, work, available)
    if given is not None:
        micro, how = min(given, work.samples), "given"
    elif saved is not None:
        micro, how = min(saved, work.samples), "saved"
    else:
        micro, how = choose_micro_batch(size, work, available), "chosen"
    plan = MemoryPlan(size, work, micro, how, available, estimate(size, work, *work.pass_of(micro)))
    if available is None or plan.estimate.peak <= available:
        return plan
    need = f"needs ~{_gib(plan.estimate.peak)} per rank, more than the {_gib(available)} free"
    fits = largest_fitting(size, work, available)
    lower = (
        f"--micro-batch-size {fits} fits"
        if fits
        else "not even one sample fits: lower --rollout-max-response-len, train an adapter "
        "(--lora-rank) or shard over more ranks (torchrun)"
    )
    if how == "given":
        raise UserError(f"--micro-batch-size {given} {need}; {lower}")
    if how == "saved":
        raise UserError(
            f"this run chose micro-batches of {saved} samples at its start (its checkpoint "
            f"keeps it, so a resume is bit-exact); here that {need}. Give --micro-batch-size "
            f"to change it ({lower}; the rollouts after the resume then differ)"
        )
    raise UserError(f"training {need}: {lower}")


def _plan_tokens(size: ModelSize, work: Workload, available: int | None) -> MemoryPlan:
    """The plan of packed micro-batches of at most `work.max_tokens` tokens: refused where one
    sample cannot fit the budget, or the budget's pass cannot fit the memory free."""
    budget, longest = work.max_tokens, work.tokens_per_sample
    if budget < longest:
        raise UserError(
            f"--max-tokens-per-gpu {budget} is less than one sample: prompts of up to "
            f"{work.prompt_tokens} tokens + --rollout-max-response-len {work.response_tokens} "
            f"= {longest}; give at least {longest}"
        )
    plan = MemoryPlan(
        size, work, work.samples, "tokens", available, estimate(size, work, budget, budget)
    )
    if available is None or plan.estimate.peak <= available:
        return plan
    fits = [t for t in range(longest, budget, max(1, (budget - longest) // 64))]
    fits = [t for t in fits if estimate(size, work, t, t).peak <= available]
    lower = (
        f"--max-tokens-per-gpu {max(fits)} fits"
        if fits
        else "not even one sample fits: lower --rollout-max-response-len, train an adapter "
        "(--lora-rank) or shard over more ranks (torchrun)"
    )
    raise UserError(
        f"--max-tokens-per-gpu {budget} needs ~{_gib(plan.estimate.peak)} per rank, more than "
        f"the {_gib(available)} free; {lower}"
    )


def _gib(count: int) -> str:
    return f"{count / GiB:.2f} GiB"
