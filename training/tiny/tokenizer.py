"""The tiny model's tokenizer and chat template.

A byte-level BPE (HF ``tokenizers``) with every digit its own token (``Digits(individual_digits=True)``
before the byte-level split) and a small vocabulary (``VOCAB_SIZE`` = 512 ids, of which 256 are the byte
alphabet). ``<think>`` and ``</think>`` are *normal* added tokens (not special) so that decoding with
``skip_special_tokens`` keeps them and vLLM's ``qwen3`` reasoning parser can split the thought from the
answer; ``<|im_start|>``, ``<|im_end|>`` (end of turn = EOS) and ``<|endoftext|>`` (padding) are special.

Chat template (Qwen3-style ChatML): each message renders ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; an
assistant message with ``reasoning_content`` (or ``reasoning``) renders ``<think>\\n{reasoning}\\n</think>\\n\\n``
before its content; the generation prompt is ``<|im_start|>assistant\\n<think>\\n`` — or
``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`` when ``enable_thinking`` is false.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- set reasoning = message.get('reasoning_content') or message.get('reasoning') -%}"
    "{%- if message['role'] == 'assistant' and reasoning -%}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def render_prompt(messages: list[dict[str, str]], enable_thinking: bool = True) -> str:
    """Pure-Python equivalent of ``CHAT_TEMPLATE`` with ``add_generation_prompt=True`` for plain-text
    messages (used to build training data fast; a test checks it matches the Jinja template)."""
    out = [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages]
    out.append(f"{IM_START}assistant\n")
    out.append(f"{THINK_START}\n\n{THINK_END}\n\n" if not enable_thinking else f"{THINK_START}\n")
    return "".join(out)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Any:
    """Train the byte-level BPE on ``corpus`` (strings) and wrap it as a ``PreTrainedTokenizerFast``.

    Returns the transformers tokenizer (``eos_token`` = ``<|im_end|>``, ``pad_token`` = ``<|endoftext|>``,
    ``chat_template`` set); save it with ``save_pretrained(dir)``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,  # room for the two think tags added below
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens(
        [
            AddedToken(THINK_START, special=False, normalized=False),
            AddedToken(THINK_END, special=False, normalized=False),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
