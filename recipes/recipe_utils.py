"""Shared pieces of the recipes: a deterministic text corpus, a tokenizer trained on it in
seconds, data sharding by data-parallel rank, and progress/metrics on rank 0.

No network is needed: the default corpus is generated from a fixed seed, and the tokenizer is
trained on it. A real job passes --dataset (a text file or a Hugging Face `datasets` name) and
--model-name-or-path instead.
"""

from __future__ import annotations

import json
import os
import random
import resource
import time
from pathlib import Path

import torch

SUBJECTS = ["the cat", "a dog", "the model", "my friend", "the engineer", "a small robot", "the teacher", "our team"]
VERBS = ["sees", "builds", "trains", "likes", "moves", "finds", "reads", "writes"]
OBJECTS = ["the red ball", "a long letter", "the big machine", "a quiet garden", "the old book", "a new idea",
           "the blue door", "a warm cup of tea"]
ENDINGS = ["today", "every morning", "in the park", "with great care", "before lunch", "at night", "again", "slowly"]


def make_corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Simple English sentences from a fixed grammar: learnable in a few minutes on a CPU."""
    rng = random.Random(seed)
    return [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)} ."
            for _ in range(lines)]


def load_texts(dataset: str | None, lines: int, seed: int) -> list[str]:
    if not dataset:
        return make_corpus(lines, seed)
    if os.path.exists(dataset):
        return [t for t in Path(dataset).read_text().splitlines() if t.strip()]
    from datasets import load_dataset  # real data: a Hugging Face dataset name (needs network access)

    return [t for t in load_dataset(dataset, split="train")["text"] if t.strip()]


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """A byte-level BPE tokenizer trained on the corpus, saved in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def token_blocks(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Concatenate all texts (eos between them) and cut into [N, seq_len] blocks."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t)["input_ids"] + [tokenizer.eos_token_id])
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def batches(blocks: torch.Tensor, step: int, per_rank_batch: int, dp_rank: int, dp_size: int, seed: int):
    """The rows this data-parallel rank reads at `step`: a fixed permutation per epoch, cut into
    global batches of per_rank_batch * dp_size rows, of which rank r takes the r-th slice."""
    global_batch = per_rank_batch * dp_size
    per_epoch = len(blocks) // global_batch
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed + epoch))
    rows = order[index * global_batch:(index + 1) * global_batch]
    return blocks[rows[dp_rank * per_rank_batch:(dp_rank + 1) * per_rank_batch]]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Progress:
    """tqdm bar with loss, tokens/s and ETA on rank 0; one JSON line per step in metrics.jsonl."""

    def __init__(self, total: int, run_dir: Path, enabled: bool):
        import sys

        from tqdm import tqdm

        self.enabled = enabled
        # Under a launcher stderr is a pipe: a redrawn bar would become thousands of lines, so
        # print a plain progress line every 5% instead.
        self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=total, disable=not (enabled and self.interactive), dynamic_ncols=True, unit="step")
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.every = max(1, total // 20)
        self.metrics = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.last = time.perf_counter()

    def update(self, step: int, loss: float, tokens: int, **extra) -> None:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        if not self.enabled:
            return
        record = {"step": step, "loss": loss, "step_time_s": elapsed, "tokens_per_s": tokens / max(elapsed, 1e-9),
                  **extra}
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        self.bar.update(1)
        self.done += 1
        if not self.interactive and (self.done % self.every == 0 or self.done == self.total):
            spent = now - self.start
            eta = spent / self.done * (self.total - self.done)
            print(f"step {step} ({self.done}/{self.total}) loss {loss:.4f} tokens/s {record['tokens_per_s']:.0f} "
                  f"eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.metrics.close()


def digits(samples: int, seed: int = 0):
    """Generated 1x28x28 "digits" standing in for MNIST (no download): the label is the brightest
    of 10 horizontal bands."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=g)
    images = torch.randn(samples, 1, 28, 28, generator=g) * 0.3
    for i, y in enumerate(labels):
        images[i, 0, 2 * y + 4:2 * y + 7, :] += 1.0
    return torch.utils.data.TensorDataset(images, labels)
