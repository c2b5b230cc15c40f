"""The SFT recipe of the tiny reasoning model (``thinkgate train tiny``).

Steps: fit the tokenizer on a generated corpus → build the Llama (:mod:`training.tiny.model`) → train with
AdamW on freshly generated examples (:mod:`training.tiny.data`) under a curriculum on the number of
operations → save a Hugging Face directory (float32 safetensors, tokenizer with chat template,
``generation_config.json``) that transformers and vLLM load. Everything is seeded (``random`` string seeds,
``torch.manual_seed``), single-process, CPU; ``torch.set_num_threads(threads)``.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training.tiny.data import OVERTHINK_MIX, STAGE2_MIX, Example, Mix, corpus, sample_example
from training.tiny.model import TinyArch, build_model
from training.tiny.tokenizer import IM_END, IM_START, PAD, train_tokenizer


@dataclass
class SFTConfig:
    """Hyper-parameters of one SFT stage; the defaults are stage 1 of the recipe (see :func:`recipe`)."""

    steps: int = 3000
    batch_size: int = 24
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1  # 1 beats 2 on a shared 2-core box: OpenMP threads spin-wait on a busy core (measured 3-5x)
    max_difficulty: int = 6
    curriculum_frac: float = 0.5  # fraction of steps over which the max difficulty rises from 2 to max
    max_minutes: float = 22.0  # wall-time bound of the schedule (see progress_at); training stops there too
    tokenizer_docs: int = 4000
    bucket_batches: int = 4  # batches drawn together and sorted by length, to cut padding
    mix: Mix = field(default_factory=Mix)
    arch: TinyArch = field(default_factory=TinyArch)
    init_from: str | None = None  # continue from this model directory (its tokenizer and weights) instead of scratch


def max_difficulty_at(progress: float, cfg: SFTConfig) -> int:
    """Curriculum: the largest number of operations sampled at ``progress`` ∈ [0, 1] of the run (2 at the start,
    ``max_difficulty`` from ``curriculum_frac`` on)."""
    extra = (cfg.max_difficulty - 2) * min(1.0, progress / max(1e-9, cfg.curriculum_frac))
    return min(cfg.max_difficulty, 2 + math.floor(extra + 1e-9))


def lr_at(progress: float, cfg: SFTConfig) -> float:
    """Linear warm-up over ``warmup_steps`` then cosine decay to ``min_lr_ratio * lr`` at ``progress`` = 1."""
    warm = cfg.warmup_steps / max(1, cfg.steps)
    if progress < warm:
        return cfg.lr * max(progress, 1 / max(1, cfg.steps)) / warm
    p = (progress - warm) / max(1e-9, 1 - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def progress_at(step: int, elapsed_s: float, cfg: SFTConfig) -> float:
    """Fraction of the run done: steps done, or wall time used of ``max_minutes`` if that is further along.

    On a box fast enough for ``steps`` within ``max_minutes`` the schedule is purely step-based (reproducible);
    on a slower one the learning-rate decay and the curriculum still complete by the time bound.
    """
    return min(1.0, max(step / max(1, cfg.steps), elapsed_s / (cfg.max_minutes * 60)))


#: ``(tokenizer, rng, difficulty, mix) -> Example``: where SFT examples come from
Sampler = Callable[[Any, random.Random, int, Mix], Example]


def batches(
    tokenizer: Any, cfg: SFTConfig, progress: Callable[[], float], sampler: Sampler = sample_example
) -> Iterator[list[Example]]:
    """Endless batches of examples; ``bucket_batches`` batches are drawn at once and grouped by length.

    ``progress()`` (∈ [0, 1]) sets the curriculum's largest difficulty for each pool; ``sampler`` draws one
    example (default: the recipe's :func:`~training.tiny.data.sample_example`).
    """
    rng = random.Random(f"sft|{cfg.seed}")
    while True:
        pool: list[Example] = []
        top = max_difficulty_at(progress(), cfg)
        for _ in range(cfg.bucket_batches):
            pool += [sampler(tokenizer, rng, rng.randint(1, top), cfg.mix) for _ in range(cfg.batch_size)]
        pool.sort(key=lambda e: len(e.input_ids))
        group = [pool[k : k + cfg.batch_size] for k in range(0, len(pool), cfg.batch_size)]
        rng.shuffle(group)
        yield from group


def collate(batch: list[Example], pad_id: int) -> tuple[Any, Any, Any]:
    """Right-pad to the longest example: (input_ids, attention_mask, labels), each LongTensor [B, T]."""
    import torch

    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, e in enumerate(batch):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e.labels)
    return ids, mask, labels


def build_tokenizer(cfg: SFTConfig) -> Any:
    """Fit the tokenizer deterministically from ``cfg.seed``."""
    return train_tokenizer(corpus(cfg.tokenizer_docs, cfg.seed))


def train(
    cfg: SFTConfig,
    output_dir: Path,
    log: Callable[[str], None] = print,
    show_progress: bool = True,
    sampler: Sampler = sample_example,
    on_step: Callable[[int, list[Example]], None] | None = None,
) -> dict[str, Any]:
    """Run the recipe and save the model to ``output_dir``; returns a summary dict (also saved as
    ``training_summary.json``: steps done, final loss, wall seconds, parameter count, config). ``sampler``: see
    :func:`batches`. ``on_step(step, batch)``: called once with ``(0, [])`` when the model is loaded and the loop
    starts, then after every optimizer step with the batch it trained on (a cost ledger bills from it)."""
    import torch
    from tqdm import tqdm

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.monotonic()
    if cfg.init_from:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.init_from)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IM_START, IM_END, PAD)}
        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
        log(f"continuing from {cfg.init_from}")
    else:
        tokenizer = build_tokenizer(cfg)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IM_START, IM_END, PAD)}
        model = build_model(len(tokenizer), ids[IM_START], ids[IM_END], ids[PAD], cfg.arch)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"tokenizer: {len(tokenizer)} tokens; model: {n_params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    model.train()
    ema = None
    step = 0
    bar = tqdm(total=cfg.steps, disable=not show_progress, mininterval=5.0, desc="sft")
    t_train = time.monotonic()
    deadline = t_train + cfg.max_minutes * 60 + 30  # the schedule ends at max_minutes; this is a backstop

    def progress() -> float:
        return progress_at(step, time.monotonic() - t_train, cfg)

    if on_step is not None:
        on_step(0, [])
    for batch in batches(tokenizer, cfg, progress, sampler):
        if step >= cfg.steps:
            break
        if time.monotonic() > deadline:
            log(f"time bound of {cfg.max_minutes} min reached at step {step}; stopping")
            break
        lr = lr_at(progress(), cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        x, _, y = collate(batch, ids[PAD])
        # Right padding under a causal mask: no real token attends to a later pad, and pads carry no loss,
        # so the padding mask is unnecessary — and dropping it keeps SDPA on its fast causal path (≈2.5× here).
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        step += 1
        if on_step is not None:
            on_step(step, batch)
        bar.update(1)
        done = progress()
        bar.set_postfix(loss=f"{ema:.3f}", maxd=max_difficulty_at(done, cfg), T=x.shape[1], refresh=False)
        if step % 100 == 0:
            log(
                f"step {step} loss {ema:.4f} lr {lr:.2e} progress {done:.2f} maxd {max_difficulty_at(done, cfg)} "
                f"elapsed {time.monotonic() - t0:.0f}s"
            )
    bar.close()
    summary = {
        "steps_done": step,
        "final_loss_ema": ema,
        "wall_s": round(time.monotonic() - t0, 1),
        "parameters": n_params,
        "config": asdict(cfg),
    }
    save(model, tokenizer, output_dir, summary)
    log(f"saved to {output_dir} ({summary['wall_s']} s)")
    return summary


def save(model: Any, tokenizer: Any, output_dir: Path, summary: dict[str, Any]) -> None:
    """Write the HF model directory: config, float32 safetensors, tokenizer + chat template, generation config."""
    from transformers import GenerationConfig

    output_dir.mkdir(parents=True, exist_ok=True)
    model.config.torch_dtype = "float32"
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    # Portability to older transformers (e.g. a GPU host's vLLM): name the class they know and embed the
    # chat template in tokenizer_config.json too (transformers ≥ 4.47 / 5.x also read chat_template.jinja).
    tc_path = output_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = tokenizer.chat_template
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=False
    ).save_pretrained(output_dir)
    (output_dir / "training_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")


def recipe(
    seed: int = 0,
    steps: tuple[int, int] = (3000, 2500),
    max_minutes: tuple[float, float] = (22.0, 18.0),
    threads: int = 1,
    arch: TinyArch | None = None,
) -> tuple[SFTConfig, SFTConfig]:
    """The two stages that made the shipped model.

    Stage 1: from scratch, batch 24, peak LR 2e-3, curriculum 2→6 operations over the first half, the
    default :class:`Mix`. Stage 2: continues from stage 1 (``init_from`` is filled in by
    :func:`train_recipe`), batch 16, peak LR 1e-3, all difficulties from the start, :data:`STAGE2_MIX`, a
    different data seed (``seed + 1``) so that it sees new examples.
    """
    a = arch or TinyArch()
    s1 = SFTConfig(steps=steps[0], seed=seed, threads=threads, max_minutes=max_minutes[0], arch=a)
    s2 = SFTConfig(
        steps=steps[1],
        batch_size=16,
        lr=1e-3,
        warmup_steps=50,
        curriculum_frac=0.0,
        seed=seed + 1,
        threads=threads,
        max_minutes=max_minutes[1],
        mix=STAGE2_MIX,
        arch=a,
    )
    return s1, s2


def train_recipe(
    stages: tuple[SFTConfig, SFTConfig],
    output_dir: Path,
    log: Callable[[str], None] = print,
    show_progress: bool = True,
    on_step: Callable[[int, list[Example]], None] | None = None,
) -> dict[str, Any]:
    """Run both stages; stage 1 is written to ``output_dir/stage1`` (deleted afterwards), stage 2 to
    ``output_dir``. Returns stage 2's summary with ``stages`` (both summaries) and total ``wall_s``. ``on_step``:
    :func:`train`'s hook, passed to both stages (a cost ledger bills the two as one run)."""
    import shutil
    from dataclasses import replace

    s1, s2 = stages
    tmp = output_dir / "stage1"
    log("stage 1: from scratch")
    sum1 = train(s1, tmp, log=log, show_progress=show_progress, on_step=on_step)
    log("stage 2: continued")
    sum2 = train(replace(s2, init_from=str(tmp)), output_dir, log=log, show_progress=show_progress, on_step=on_step)
    shutil.rmtree(tmp, ignore_errors=True)
    total = {**sum2, "wall_s": round(sum1["wall_s"] + sum2["wall_s"], 1), "stages": [sum1, sum2]}
    (output_dir / "training_summary.json").write_text(json.dumps(total, indent=2, default=str) + "\n")
    return total


def overthink_stage(
    init_from: str, seed: int = 2, steps: int = 1400, max_minutes: float = 14.0, threads: int = 1
) -> SFTConfig:
    """Stage 3 that made v2 (the shipped over-thinker): continue a two-stage model at peak LR 5e-4, batch 16,
    all difficulties, :data:`~training.tiny.data.OVERTHINK_MIX`, a fresh data seed."""
    return SFTConfig(
        steps=steps,
        batch_size=16,
        lr=5e-4,
        warmup_steps=30,
        curriculum_frac=0.0,
        seed=seed,
        threads=threads,
        max_minutes=max_minutes,
        mix=OVERTHINK_MIX,
        init_from=init_from,
    )


def train_overthink(
    cfg: SFTConfig,
    output_dir: Path,
    log: Callable[[str], None] = print,
    show_progress: bool = True,
    earlier: list[dict[str, Any]] | None = None,
    on_step: Callable[[int, list[Example]], None] | None = None,
) -> dict[str, Any]:
    """Run stage 3 (``cfg`` from :func:`overthink_stage`) into ``output_dir``; the summary lists every stage:
    ``earlier`` (stages 1–2 when run in the same command) or those recorded in the ``init_from`` directory's
    ``training_summary.json``, then this one; ``wall_s`` is the total. ``on_step``: :func:`train`'s hook."""
    if earlier is None:
        prev = Path(cfg.init_from or "") / "training_summary.json"
        earlier = json.loads(prev.read_text()).get("stages", []) if prev.is_file() else []
    log("stage 3: over-thinking (verbose thoughts), continued")
    s3 = train(cfg, output_dir, log=log, show_progress=show_progress, on_step=on_step)
    stages = [*earlier, s3]
    total = {**s3, "wall_s": round(sum(s["wall_s"] for s in stages), 1), "stages": stages}
    (output_dir / "training_summary.json").write_text(json.dumps(total, indent=2, default=str) + "\n")
    return total
