"""The tiny model's tokenizer, chat template, data and a few-step SFT smoke run (CPU, seconds)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gateway.config import DEFAULT_MODEL_DIR
from router.tasks.arithmetic import Chain, Op
from training.tiny.data import Mix, corpus, make_example, thought
from training.tiny.tokenizer import IM_END, THINK_END, THINK_START, render_prompt, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return train_tokenizer(corpus(600, seed=0))


def test_think_tags_are_single_normal_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    for tag in (THINK_START, THINK_END):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) == 1
        assert tag not in tokenizer.all_special_tokens
    text = "<think>\n7 + 5 = 12\n</think>\n\nThe answer is 12."
    ids = tokenizer.encode(text, add_special_tokens=False)
    # normal tokens survive skip_special_tokens (vLLM's qwen3 parser needs them in the text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert IM_END in tokenizer.all_special_tokens and tokenizer.eos_token == IM_END


def test_digits_are_single_tokens_and_round_trip(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode("1234 + 56 = 1290", add_special_tokens=False)
    toks = tokenizer.convert_ids_to_tokens(ids)
    assert [t for t in toks if any(c.isdigit() for c in t)] == list("1234561290")
    for s in ["Start with 7. Add 5, then multiply by 3. What is the result?", "héllo ✓ 😀 tabs\tand\nlines", ""]:
        assert tokenizer.decode(tokenizer.encode(s, add_special_tokens=False)) == s
    assert len(tokenizer) <= 512


def test_chat_template_thinking_on_and_off(tokenizer) -> None:  # type: ignore[no-untyped-def]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Start with 2. Add 3."}]
    on = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    off = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on == render_prompt(msgs) and off == render_prompt(msgs, enable_thinking=False)
    assert on.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nStart with 2. Add 3.<|im_end|>\n")
    # history with an assistant turn carrying its reasoning separately
    hist = [*msgs, {"role": "assistant", "content": "The answer is 5.", "reasoning_content": "2 + 3 = 5"}]
    rendered = tokenizer.apply_chat_template(hist, tokenize=False)
    assert "<|im_start|>assistant\n<think>\n2 + 3 = 5\n</think>\n\nThe answer is 5.<|im_end|>\n" in rendered


def test_examples_mask_prompt_and_forced_end(tokenizer) -> None:  # type: ignore[no-untyped-def]
    chain = Chain(7, (Op("add", 5), Op("mul", 3)))
    end_id = tokenizer.convert_tokens_to_ids(THINK_END)
    kinds = {}
    rng = random.Random(0)
    for _ in range(200):
        ex = make_example(tokenizer, chain, "Start with 7. Add 5, then multiply by 3.", rng, Mix())
        assert len(ex.input_ids) == len(ex.labels)
        text = tokenizer.decode(ex.input_ids)
        assert text.endswith("The answer is 36.<|im_end|>")
        first_loss = next(i for i, y in enumerate(ex.labels) if y != -100)
        assert tokenizer.decode(ex.input_ids[:first_loss]).endswith(("<think>\n", "</think>", "</think>\n\n"))
        if ex.kind == "truncated":
            # the forced </think> is in the input but never a target
            pos = ex.input_ids.index(end_id)
            assert ex.labels[pos] == -100
        elif ex.kind != "direct":
            assert ex.labels[ex.input_ids.index(end_id)] == end_id
        kinds[ex.kind] = kinds.get(ex.kind, 0) + 1
    assert set(kinds) == {"direct", "truncated", "terse", "medium", "verbose"}
    assert thought(chain, "terse", rng) == "7 + 5 = 12\n12 * 3 = 36\n"
    verbose = thought(chain, "verbose", random.Random(1))
    assert "12 * 3 = 36" in verbose and len(verbose) > 2 * len(thought(chain, "terse", rng))


def test_sft_smoke_run_saves_a_loadable_model(tmp_path: Path) -> None:
    """Both stages of the recipe (scratch, then continued) on a toy-sized model, a few steps each."""
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from router.tasks import load_task
    from training.tiny.evaluate import run
    from training.tiny.model import TinyArch
    from training.tiny.train import recipe, train_recipe

    arch = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1)
    s1, s2 = recipe(seed=0, steps=(6, 4), arch=arch)
    s1 = replace(s1, batch_size=4, warmup_steps=2, tokenizer_docs=300, bucket_batches=2)
    s2 = replace(s2, batch_size=4, warmup_steps=1, bucket_batches=2)
    summary = train_recipe((s1, s2), tmp_path, log=lambda _: None, show_progress=False)
    assert [s["steps_done"] for s in summary["stages"]] == [6, 4]
    assert summary["stages"][1]["config"]["init_from"] == str(tmp_path / "stage1")
    assert not (tmp_path / "stage1").exists()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "training_summary.json"):
        assert (tmp_path / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tok)
    assert model.config.hidden_size == 32
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    torch.manual_seed(0)
    out = run(model, tok, load_task("arith", "test", 2), budget=5, max_answer=4)
    # budget 5 → at most 4 thought tokens, then the forced </think>
    assert all(o.thought_tokens <= 5 and o.text.count(THINK_END) >= 1 for o in out)


def test_shipped_model_is_small_and_complete() -> None:
    d = DEFAULT_MODEL_DIR
    size = (d / "model.safetensors").stat().st_size
    assert size <= 10 * 1024 * 1024, f"{size} bytes"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert (d / "README.md").read_text().count("Apache-2.0") >= 1
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert "<think>\\n" in json.dumps(tok_cfg.get("chat_template", "")) or (d / "chat_template.jinja").is_file()


def test_overthink_stage_continues_and_records_every_stage(tmp_path: Path) -> None:
    """Stage 3 continues a saved model on the over-thinking mix; its summary lists the earlier stages too."""
    from dataclasses import replace

    from training.tiny.data import OVERTHINK_MIX, sample_example
    from training.tiny.model import TinyArch
    from training.tiny.train import overthink_stage, recipe, train_overthink, train_recipe

    arch = TinyArch(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1)
    s1, s2 = recipe(seed=0, steps=(3, 2), arch=arch)
    s1 = replace(s1, batch_size=4, warmup_steps=1, tokenizer_docs=300, bucket_batches=2)
    s2 = replace(s2, batch_size=4, warmup_steps=1, bucket_batches=2)
    two = tmp_path / "two"
    train_recipe((s1, s2), two, log=lambda _: None, show_progress=False)
    s3 = replace(overthink_stage(str(two), steps=2), batch_size=4, warmup_steps=1, bucket_batches=2)
    summary = train_overthink(s3, tmp_path / "three", log=lambda _: None, show_progress=False)
    assert [s["steps_done"] for s in summary["stages"]] == [3, 2, 2]
    assert summary["stages"][2]["config"]["mix"]["verbose"] == OVERTHINK_MIX.verbose
    assert summary["wall_s"] >= summary["stages"][2]["wall_s"]
    on_disk = json.loads((tmp_path / "three" / "training_summary.json").read_text())
    assert len(on_disk["stages"]) == 3

    # the mix really is mostly verbose: count full-thought kinds over a fixed stream
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(two)
    rng = random.Random(0)
    kinds = [sample_example(tok, rng, 2, OVERTHINK_MIX).kind for _ in range(400)]
    full = [k for k in kinds if k in ("terse", "medium", "verbose")]
    assert "medium" not in full
    assert 0.7 < full.count("verbose") / len(full) < 0.9


def test_shipped_length_penalised_model_is_complete_and_shorter() -> None:
    """``thinkgate-tiny-short`` (GRPO from the shipped SFT model) ships with its run's evaluation: the same greedy
    held-out accuracy (within 2 points) at less than half the thought tokens, and a tier snippet."""
    import yaml

    d = DEFAULT_MODEL_DIR.parent / "thinkgate-tiny-short"
    assert (d / "model.safetensors").stat().st_size <= 10 * 1024 * 1024
    cfg, base = (json.loads((x / "config.json").read_text()) for x in (d, DEFAULT_MODEL_DIR))
    assert {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")} == {
        k: base[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    assert "apache-2.0" in (d / "README.md").read_text()
    before, after = (json.loads((d / f"eval_{k}.json").read_text())["overall"] for k in ("before", "after"))
    assert after["accuracy"] >= before["accuracy"] - 0.02
    assert after["mean_thought_tokens"] < 0.5 * before["mean_thought_tokens"]
    tier = yaml.safe_load((d / "tier.yaml").read_text())["tiers"][0]
    assert tier["name"] == "short" and tier["model"] == "thinkgate-tiny-short"
