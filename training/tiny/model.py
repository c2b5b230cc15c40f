"""The tiny Llama: architecture constants and constructor (Hugging Face ``LlamaForCausalLM``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TinyArch:
    """Architecture of the tiny model (≈1.7M parameters; ≈6.9 MB as float32 safetensors).

    ``max_position_embeddings`` bounds the context vLLM may serve (``--max-model-len`` ≤ it); RoPE has no
    parameters, so it costs nothing.
    """

    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


def build_model(vocab_size: int, bos_id: int, eos_id: int, pad_id: int, arch: TinyArch | None = None) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` (float32, tied embeddings, SDPA attention).

    Seed torch before calling for a reproducible init.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    a = arch or TinyArch()
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads,
        max_position_embeddings=a.max_position_embeddings,
        rope_theta=a.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)
