"""A random-init tiny Llama + tokenizer with the project's chat conventions, for tests and offline smoke runs.

Not a reasoning model (untrained): it exists so the GRPO machinery can be exercised in seconds without the shipped
model. Conventions match ``training/assets/thinkgate-tiny``: ``<think>``/``</think>`` are normal tokens and the
chat template's generation prompt ends with ``<think>\\n``.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)

_CORPUS = [
    "What is 3 + 4? <think>\n3 + 4 = 7\n</think>\n\n7",
    "Compute 12 * 3 - 5. <think>\n12 * 3 = 36, 36 - 5 = 31\n</think>\n\n31",
    "0123456789 +-*/=()., abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ ?!:;'\"",
    "Think for 32 tokens. Think for maximum 64 tokens.",
]


def build_tiny_model(out_dir: str | Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Write a random-init ``LlamaForCausalLM`` and a byte-level BPE tokenizer to ``out_dir``; returns the path."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.add_tokens(["<think>", "</think>"])  # normal tokens: kept on decode
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|eos|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=fast.pad_token_id,
        eos_token_id=fast.eos_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(out)
    return out
