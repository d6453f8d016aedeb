"""`mileage serve`'s LoRA adapters: SGLang's dynamic adapter API over the in-process engine.

Endpoints (SGLang's names and shapes, the subset mileage uses):
- `POST /load_lora_adapter` `{lora_name, lora_path}`: a PEFT adapter directory
  (adapter_config.json + adapter_model.safetensors) becomes adapter `lora_name`;
- `POST /load_lora_adapter_from_tensors` `{lora_name, config_dict, serialized_tensors,
  load_format: "safetensors_base64"}`: the same, with the adapter's tensors in the request as
  base64 safetensors bytes (SGLang's own format here is a pickle, which this server never
  unpickles: a pickle is code);
- `POST /unload_lora_adapter` `{lora_name}`;
- `POST /update_weight_version` `{new_version}`: relabels the weights (an adapter update);
- `/generate` with `lora_path` (one name, or one per row, all rows the same) runs the base with
  that adapter; without it, the base alone.
Replies are SGLang's `{success, error_message, loaded_adapters}`.

The adapter is PEFT's own LoRA layer injected into the served model, the same module the
trainer runs: in eval mode a row's log-probs are the trainer's (local engine's) bit for bit when
both compute in the same precision. A full weight update (`/update_weights_from_disk`) replaces
the model and so drops every adapter, which must then be loaded again.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from mileage.errors import UserError
from mileage.rollout.engines.adapters import TENSOR_FORMAT


class AdapterError(ValueError):
    """A load or unload the server refuses (reply: success false, with the reason)."""


def _lora_config(config_dict: dict):
    import peft

    known = {f.name for f in dataclasses.fields(peft.LoraConfig) if f.init}
    if str(config_dict.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"peft_type {config_dict.get('peft_type')!r} is not LORA")
    try:
        config = peft.LoraConfig(**{k: v for k, v in config_dict.items() if k in known})
    except (TypeError, ValueError) as exc:
        raise AdapterError(f"bad adapter config: {exc}") from None
    config.inference_mode = True
    return config


def decode_tensors(body: dict) -> dict[str, torch.Tensor]:
    """The tensors of a `/load_lora_adapter_from_tensors` request (safetensors bytes only)."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_bytes

    if body.get("load_format") != TENSOR_FORMAT:
        raise AdapterError(
            f"mileage serve takes adapter tensors as load_format {TENSOR_FORMAT!r} (safetensors "
            f"bytes, base64), not {body.get('load_format')!r} (SGLang's default is a pickle)"
        )
    data = body.get("serialized_tensors")
    if not isinstance(data, str):
        raise AdapterError("serialized_tensors must be a base64 string")
    try:
        return load_bytes(base64.b64decode(data, validate=True))
    except (ValueError, SafetensorError) as exc:
        raise AdapterError(f"serialized_tensors is not base64 safetensors: {exc}") from None


def read_adapter_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from mileage.models.lora import read_adapter

    try:
        return read_adapter(Path(path))
    except UserError as exc:
        raise AdapterError(str(exc).replace("--lora-adapter-path ", "")) from None


class ServedAdapters:
    """The adapters loaded into one served model, by name."""

    def __init__(self) -> None:
        self.peft_model = None  # the PeftModel around the served model, once one is loaded
        self.paths: dict[str, str] = {}  # name -> where it came from ("__tensor__": a request)

    def reset(self) -> None:
        """The served model was replaced: its adapters went with it."""
        self.peft_model = None
        self.paths.clear()

    def loaded(self) -> dict[str, dict]:
        return {name: {"lora_name": name, "lora_path": p} for name, p in self.paths.items()}

    def load(self, model: torch.nn.Module, name: str, config_dict: dict, tensors, source: str):
        """Inject adapter `name` into `model` (in place) and load its tensors."""
        import peft
        from peft import set_peft_model_state_dict

        if not isinstance(name, str) or not name:
            raise AdapterError("lora_name must be a non-empty string")
        if name in self.paths:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first")
        config = _lora_config(config_dict)
        try:
            if self.peft_model is None:
                with warnings.catch_warnings():  # PEFT asks transformers a deprecated question
                    warnings.filterwarnings("ignore", category=FutureWarning)
                    self.peft_model = peft.get_peft_model(model, config, adapter_name=name)
            else:
                self.peft_model.add_adapter(name, config)
            result = set_peft_model_state_dict(self.peft_model, tensors, adapter_name=name)
        except (ValueError, RuntimeError, KeyError) as exc:
            self._drop(name)
            raise AdapterError(f"adapter {name!r} does not fit the served model: {exc}") from None
        # every tensor of the adapter must have arrived: a missing lora_A would leave PEFT's
        # random initialisation in place and generate from an adapter nobody trained
        missing = [k for k in result.missing_keys if f".{name}." in k and "lora_" in k]
        unexpected = [k for k in result.unexpected_keys if "lora_" in k]
        if missing or unexpected:
            self._drop(name)
            raise AdapterError(
                f"adapter {name!r} does not match its config: "
                f"{'missing ' + missing[0] if missing else 'unexpected ' + unexpected[0]}"
            )
        self.peft_model.eval()
        self.paths[name] = source

    def _drop(self, name: str) -> None:
        if self.peft_model is None or name not in self.peft_model.peft_config:
            return
        if len(self.peft_model.peft_config) == 1:
            # the last adapter: take PEFT's layers out again (in place), back to the plain model
            self.peft_model.unload()
            self.peft_model = None
        else:
            # PEFT warns (UserWarning, on every adapter sync: the old adapter was the active
            # one) when the deleted adapter is active, then activates the first one left. That
            # choice is harmless here: every request activates its own adapter (`active`). So
            # this filter is scoped to the deletion and to exactly that message.
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", r"Adapter .* was active which is now deleted", UserWarning
                )
                self.peft_model.delete_adapter(name)

    def unload(self, name: str) -> None:
        if not isinstance(name, str) or name not in self.paths:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        self._drop(name)
        del self.paths[name]

    @contextlib.contextmanager
    def active(self, name: str | None) -> Iterator[None]:
        """Generate with adapter `name`, or with the base alone (None)."""
        if name is None:
            if self.peft_model is None:
                yield
                return
            with self.peft_model.disable_adapter():
                yield
            return
        if name not in self.paths:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        self.peft_model.set_adapter(name)
        yield


def lora_name_of(body: dict, rows: int) -> str | None:
    """The one adapter a `/generate` request names (`lora_path`: a name or one per row)."""
    value = body.get("lora_path")
    names = value if isinstance(value, list) else [value] * rows
    if len(names) != rows or not all(n is None or isinstance(n, str) for n in names):
        raise AdapterError("lora_path must be an adapter name or one (or null) per input")
    if len(set(names)) > 1:
        raise AdapterError("mileage serve runs one adapter per request: give every row the same")
    return names[0] if names else None


def _reply(action) -> dict:
    try:
        action()
    except AdapterError as exc:
        return {"success": False, "error_message": str(exc)}
    return {"success": True, "error_message": ""}


class AdapterEndpoints:
    """The HTTP side: each method takes a request body and the server (its lock and model)."""

    def __init__(self, server, enabled: bool) -> None:
        self.server = server
        self.enabled = enabled  # --enable-lora, as SGLang's
        self.adapters = ServedAdapters()

    def _refusal(self) -> dict | None:
        if self.enabled:
            return None
        return {
            "success": False,
            "error_message": "LoRA is not enabled: start mileage serve with --enable-lora",
        }

    def _load(self, name, config_dict: dict, tensors, source: str) -> dict:
        def load() -> None:
            with self.server.lock:
                self.adapters.load(self.server.engine.model, name, config_dict, tensors, source)

        return {**_reply(load), "loaded_adapters": self.adapters.loaded()}

    def load_from_disk(self, body: dict) -> dict:
        if refusal := self._refusal():
            return refusal
        path = body.get("lora_path")
        if not isinstance(path, str):
            return {"success": False, "error_message": "lora_path must be a string"}
        try:
            config, tensors = read_adapter_dir(path)
        except AdapterError as exc:
            return {"success": False, "error_message": str(exc)}
        return self._load(body.get("lora_name"), config, tensors, path)

    def load_from_tensors(self, body: dict) -> dict:
        if refusal := self._refusal():
            return refusal
        config = body.get("config_dict")
        try:
            if not isinstance(config, dict):
                raise AdapterError("config_dict must be an object (adapter_config.json's fields)")
            tensors = decode_tensors(body)
        except AdapterError as exc:
            return {"success": False, "error_message": str(exc)}
        return self._load(body.get("lora_name"), config, tensors, "__tensor__")

    def unload(self, body: dict) -> dict:
        if refusal := self._refusal():
            return refusal

        def unload() -> None:
            with self.server.lock:
                self.adapters.unload(body.get("lora_name"))

        return {**_reply(unload), "loaded_adapters": self.adapters.loaded()}

    def drop_all(self) -> None:
        """Before a full weight update (caller holds the lock): the model without adapters."""
        for name in list(self.adapters.paths):
            self.adapters.unload(name)
