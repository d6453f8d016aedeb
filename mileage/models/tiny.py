"""The built-in default model's architecture: a ~3M-parameter Llama with a character-level
tokenizer, and the cache directory mileage keeps models in.

Which characters the tokenizer has, the shipped weights and the warm-up that builds them belong
to the built-in tasks (`mileage.rollout.builtin_model`); this module knows nothing of tasks.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character plus <pad>/<bos>/<eos>/<unk>; every encoding starts with <bos>."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_llama_config(
    vocab_size: int,
    pad_id: int,
    bos_id: int,
    eos_id: int,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 704,
) -> LlamaConfig:
    """The built-in architecture (3.2M parameters at the defaults); tests shrink it further."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )


def mileage_home() -> Path:
    return Path(os.environ.get("MILEAGE_HOME", Path.home() / ".cache" / "mileage"))
