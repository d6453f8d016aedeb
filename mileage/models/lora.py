"""LoRA with PEFT: the flags (miles' names), adapters on a base model, and the views of it.

The policy is the base model with PEFT's LoRA layers injected; only the adapter tensors train.
The reference is the same module with the adapter switched off (`AdapterDisabled`, PEFT's
`disable_adapter()`), so a KL term costs no second copy of the weights. Engines that cannot take
an adapter get `MergedView`: a plain model whose adapted matrices are W + scale * B @ A and whose
other tensors are the base's own (shared, not copied).

PEFT is an optional dependency (`pip install mileage[lora]`); it is imported only by LoRA runs.
"""

from __future__ import annotations

import inspect
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mileage.config import option
from mileage.errors import UserError
from mileage.models.hf import ADAPTER_CONFIG
from mileage.seeding import derive_seed

ADAPTER = "default"  # PEFT's name of the one adapter a run trains
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_RECORD = "mileage_base.json"  # beside an exported adapter: the base it belongs to


@dataclass
class LoraConfig:
    lora_rank: int = option(0, "LoRA rank; 0 disables LoRA (all weights train)")
    lora_alpha: int = option(16, "LoRA alpha: the adapter's output is scaled by alpha / rank")
    lora_dropout: float = option(0.0, "dropout on the adapter's input while training")
    target_modules: str | None = option(
        None,
        "modules that get an adapter: all-linear (every linear layer but the output head) or "
        "comma-separated module names, e.g. q_proj,k_proj,v_proj,o_proj (required with LoRA)",
    )
    exclude_modules: str | None = option(
        None, "comma-separated module names taken out of --target-modules"
    )
    lora_sync_from_tensor: bool = option(
        False,
        "send the adapter to `mileage serve --enable-lora` servers inside the request "
        "(/load_lora_adapter_from_tensors) instead of through a directory they read",
    )
    lora_adapter_path: str | None = option(
        None,
        "start from this adapter (PEFT format: adapter_config.json + adapter_model.safetensors)",
    )

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    def validate(self) -> None:
        if self.lora_rank < 0:
            raise UserError(f"--lora-rank must be >= 0 (0 disables LoRA), got {self.lora_rank}")
        if not self.enabled:
            given = [
                flag
                for flag, value, default in (
                    ("--lora-alpha", self.lora_alpha, 16),
                    ("--lora-dropout", self.lora_dropout, 0.0),
                    ("--target-modules", self.target_modules, None),
                    ("--exclude-modules", self.exclude_modules, None),
                    ("--lora-adapter-path", self.lora_adapter_path, None),
                    ("--lora-sync-from-tensor", self.lora_sync_from_tensor, False),
                )
                if value != default
            ]
            if given:
                raise UserError(
                    f"{', '.join(given)} given but --lora-rank is 0 (LoRA off); "
                    "pass --lora-rank N (e.g. 16) to train an adapter"
                )
            return
        if self.lora_alpha <= 0:
            raise UserError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UserError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.target_modules or not _names(self.target_modules):
            raise UserError(
                "--lora-rank needs --target-modules: all-linear, or module names such as "
                "q_proj,k_proj,v_proj,o_proj"
            )
        require_peft()

    def record(self, targets: list[str]) -> dict:
        """What meta.json keeps of the adapter: enough to rebuild its shapes and scaling."""
        out = asdict(self)
        out.pop("lora_adapter_path")
        out.pop("lora_sync_from_tensor")  # how the engines get it, not what the adapter is
        out.pop("exclude_modules")
        out["target_modules"] = targets
        return out


def _names(text: str | None) -> list[str]:
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserError(
            "--lora-rank needs PEFT, which is not installed: pip install 'mileage[lora]'"
        ) from None


def adaptable_linear_names(model: torch.nn.Module) -> list[str]:
    """Full names of the linear layers an adapter may go on (not the output head: it is tied to
    the embedding in most small models, and neither PEFT's nor miles' all-linear includes it)."""
    head = model.get_output_embeddings()
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    ]


def resolve_targets(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """--target-modules minus --exclude-modules as module names; each must match a linear layer."""
    linear = adaptable_linear_names(model)

    def matches(name: str) -> list[str]:
        return [full for full in linear if full == name or full.endswith("." + name)]

    if cfg.target_modules.strip() == "all-linear":
        targets = sorted({full.rpartition(".")[2] for full in linear})
    else:
        targets = _names(cfg.target_modules)
        for name in targets:
            if not matches(name):
                known = sorted({full.rpartition(".")[2] for full in linear})
                raise UserError(
                    f"--target-modules {name} matches no linear layer of the model; "
                    f"its linear layers are {','.join(known)}"
                )
    for name in _names(cfg.exclude_modules):
        if name not in targets:
            raise UserError(
                f"--exclude-modules {name} is not among the target modules ({','.join(targets)})"
            )
    targets = [t for t in targets if t not in _names(cfg.exclude_modules)]
    if not targets:
        raise UserError("--exclude-modules removes every target module; nothing would train")
    return targets


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int):
    """Inject the adapter into `model` (in place); returns the PeftModel wrapping it.

    lora_A is drawn from a generator of its own, so the initial adapter depends on the seed
    alone, not on what else used the global RNG before (lora_B starts at zero: the adapted
    model starts equal to the base).
    """
    import peft

    targets = resolve_targets(model, cfg)
    config = peft.LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # PEFT asks transformers a deprecated question about gradient checkpointing
        warnings.filterwarnings("ignore", category=FutureWarning)
        torch.manual_seed(derive_seed(seed, "lora_init", 0))
        wrapped = peft.get_peft_model(model, config)
    # PEFT's new dropout modules start in training mode: generation (and a resumed run's first
    # rollout) must see the eval-mode model the trainer leaves after each step
    wrapped.eval()
    return wrapped, targets


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (adapter) tensors of an adapted model, by parameter name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class AdapterDisabled:
    """The base model as a callable: the adapted module run inside `disable_adapter()`."""

    def __init__(self, peft_model):
        self.peft_model = peft_model
        inner = peft_model.get_base_model()

        def forward(*args, **kwargs):
            with self.peft_model.disable_adapter():
                return inner(*args, **kwargs)

        forward.__signature__ = inspect.signature(inner.forward)  # keeps logits_to_keep
        self.forward = forward

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    @property
    def training(self) -> bool:
        return self.peft_model.training

    def modules(self):
        """The adapted model's modules: whether its layers are checkpointed is the policy's."""
        return self.peft_model.modules()

    def to(self, *args, **kwargs) -> AdapterDisabled:
        """Nothing to move: the weights are the policy's, which move with it."""
        return self


def merged_weight(layer) -> torch.Tensor:
    """W + scale * B @ A of one LoRA layer, without touching W (merging in place and back
    would change W's low bits)."""
    return layer.base_layer.weight + layer.get_delta_weight(ADAPTER)


class MergedView:
    """A plain model (HF names) holding the merged weights, for engines that take no adapter
    (or, with merged=False, the base alone: what an engine that takes adapters starts from).

    Non-adapted tensors share storage with the trainer's; only adapted matrices are new memory.
    `refresh()` recomputes them from the adapter.
    """

    def __init__(self, peft_model, config_dir: str, merged: bool = True):
        from peft.tuners.lora import LoraLayer

        from mileage.models.hf import empty_causal_lm

        self.peft_model = peft_model
        inner = peft_model.get_base_model()
        self.layers = {
            name: module for name, module in inner.named_modules() if isinstance(module, LoraLayer)
        }
        with torch.device("meta"):
            plain = empty_causal_lm(config_dir)
        state = {}
        for name, value in inner.state_dict().items():
            if ".lora_" in name:
                continue
            state[name.replace(".base_layer.", ".")] = value
        self.merged = merged  # False: the base alone, every tensor shared (no new memory)
        if merged:
            for name in self.layers:
                state[f"{name}.weight"] = torch.empty_like(state[f"{name}.weight"])
        plain.load_state_dict(state, assign=True, strict=False)
        plain.tie_weights()
        # non-persistent buffers (rotary inv_freq) are not in a state dict: share them too
        buffers = dict(inner.named_buffers())
        for name, _ in list(plain.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            plain.get_submodule(owner).register_buffer(leaf, buffers[name], persistent=False)
        self.model = plain.eval().requires_grad_(False)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> torch.nn.Module:
        if not self.merged:
            return self.model  # the base's own tensors, which never train
        params = dict(self.model.named_parameters())
        for name, layer in self.layers.items():
            params[f"{name}.weight"].copy_(merged_weight(layer))
        return self.model


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and the tensors of a PEFT adapter directory (one-line errors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    for file in (config_file, weights):
        if not file.is_file():
            raise UserError(
                f"--lora-adapter-path {path}: no {file.name} (a PEFT adapter directory has "
                f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
            )
    try:
        config = json.loads(config_file.read_text())
        tensors = load_file(str(weights))
    except (OSError, ValueError, SafetensorError) as exc:  # a corrupt file: one line
        raise UserError(f"--lora-adapter-path {path} is unreadable: {exc}") from None
    return config, tensors


def load_adapter(
    peft_model, path: str | Path, cfg: LoraConfig, targets: list[str], base: dict
) -> None:
    """Load a PEFT adapter into the run's adapter; refuses one of another base or shape."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    config, tensors = read_adapter(path)
    recorded = _read_base_record(Path(path))
    if recorded and recorded.get("weights_sha256") != base["weights_sha256"]:
        raise UserError(
            f"--lora-adapter-path {path} is an adapter of {recorded.get('path')} (weights "
            f"{str(recorded.get('weights_sha256'))[:12]}), not of this run's base {base['path']} "
            f"(weights {base['weights_sha256'][:12]})"
        )
    theirs = {"r": config.get("r"), "lora_alpha": config.get("lora_alpha")}
    ours = {"r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha}
    if theirs != ours:
        raise UserError(
            f"--lora-adapter-path {path} has rank {theirs['r']}, alpha {theirs['lora_alpha']}; "
            f"pass --lora-rank {theirs['r']} --lora-alpha {theirs['lora_alpha']}"
        )
    expected = set(get_peft_model_state_dict(peft_model))
    try:
        result = set_peft_model_state_dict(peft_model, tensors)
    except RuntimeError as exc:  # shapes that do not fit: another base model
        first = str(exc).strip().splitlines()[-1].strip()
        raise UserError(
            f"--lora-adapter-path {path} does not fit this run's base {base['path']} "
            f"(an adapter of {config.get('base_model_name_or_path')}?): {first}"
        ) from None
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    missing = sorted(expected - set(tensors))
    if unexpected or missing:
        raise UserError(
            f"--lora-adapter-path {path} targets other modules than --target-modules "
            f"{','.join(targets)} (e.g. {(unexpected or missing)[0]})"
        )


def _read_base_record(path: Path) -> dict | None:
    file = path / BASE_RECORD
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except ValueError:
        return None


def save_adapter(peft_model, out: Path, base: dict) -> None:
    """PEFT's adapter format (adapter_config.json + adapter_model.safetensors) + the base record."""
    peft_model.peft_config[ADAPTER].base_model_name_or_path = base["path"]
    peft_model.save_pretrained(str(out))
    (out / BASE_RECORD).write_text(json.dumps(base, indent=2) + "\n")


def save_adapter_tensors(
    peft_model, tensors: dict[str, torch.Tensor], out: Path, base: dict
) -> None:
    """`save_adapter`'s files from `tensors` (PEFT's saved names, full values) rather than the
    module's own: under torchrun rank 0 writes the adapter it gathered from the shards."""
    import copy

    from safetensors.torch import save_file

    config = copy.deepcopy(peft_model.peft_config[ADAPTER])
    config.base_model_name_or_path = base["path"]
    config.inference_mode = True  # as PEFT saves it: the adapter loads for inference
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    contiguous = {name: t.detach().contiguous() for name, t in tensors.items()}
    save_file(contiguous, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / BASE_RECORD).write_text(json.dumps(base, indent=2) + "\n")
