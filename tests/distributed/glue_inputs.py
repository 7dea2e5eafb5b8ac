"""Inputs of the GLUE-style Trainer recipe (recipes/hf_trainer/run_glue.py), made offline: tiny BERT-
and RoBERTa-style models from their config classes with a word-level tokenizer (save_pretrained into
one directory each), and CSV files of a learnable sentence-pair task."""

from __future__ import annotations

import csv
import random
from pathlib import Path

WORDS = ("the a movie film plot acting story cast was is very quite truly good great fine superb bad awful dull "
         "poor and but").split()
POSITIVE, NEGATIVE = ("good", "great", "fine", "superb"), ("bad", "awful", "dull", "poor")
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tokenizer(kind: str = "bert"):
    """BERT's pair template (second sentence of token type 1) or RoBERTa's (``A </s></s> B``, no token types:
    RoBERTa has one token type, and its tokenizer returns no ``token_type_ids``; a type-1 id would index past
    its one-row type embedding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    pair = "[CLS] $A [SEP] $B:1 [SEP]:1" if kind == "bert" else "[CLS] $A [SEP] [SEP] $B [SEP]"
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair=pair, special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    names = ["input_ids", "token_type_ids", "attention_mask"] if kind == "bert" else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_input_names=names)


def make_model(kind: str, out: Path, dropout: float = 0.0) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification, RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(0)
    common = dict(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, initializer_range=0.2, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                  num_labels=2, pad_token_id=0)
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(max_position_embeddings=40, **common))
    elif kind == "roberta":
        model = RobertaForSequenceClassification(RobertaConfig(max_position_embeddings=42, type_vocab_size=1, **common))
    else:
        raise ValueError(kind)
    model.save_pretrained(out)
    tokenizer(kind).save_pretrained(out)
    return out


def _sentence(rng, mood) -> str:
    return " ".join([rng.choice(("the", "a")), rng.choice(("movie", "film", "plot", "acting", "story", "cast")),
                     rng.choice(("was", "is")), rng.choice(mood), "and", rng.choice(mood), "and", rng.choice(mood)])


def make_csv(path: Path, n: int, seed: int, labels: bool = True) -> Path:
    """Sentence pairs (MRPC-like columns) of one mood, labelled 1 when positive."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence1", "sentence2"] + (["label"] if labels else []))
        for _ in range(n):
            a = rng.random() < 0.5
            row = [_sentence(rng, POSITIVE if a else NEGATIVE), _sentence(rng, POSITIVE if a else NEGATIVE)]
            writer.writerow(row + ([int(a)] if labels else []))
    return path


def make_inputs(root: Path, kind: str = "bert", dropout: float = 0.0) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    return {"model": make_model(kind, root / kind, dropout), "train": make_csv(root / "train.csv", 64, 0),
            "validation": make_csv(root / "dev.csv", 12, 1), "test": make_csv(root / "test.csv", 8, 2)}


def _varied_sentence(rng, mood) -> str:
    """One to three mood words: sentences of different lengths, so that padding per batch gives batches of
    different shapes."""
    words = [rng.choice(("the", "a")), rng.choice(("movie", "film", "plot", "story")), rng.choice(("was", "is"))]
    for i in range(rng.randint(1, 3)):
        words += (["and"] if i else []) + [rng.choice(mood)]
    return " ".join(words)


def make_glue_csv(path: Path, n: int, seed: int, test: bool = False) -> Path:
    """GLUE's columns as its CSV exports have them (``idx``, the sentence pair, ``label``; -1 on the test
    split, whose labels GLUE does not publish), with sentences of varied length."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["idx", "sentence1", "sentence2", "label"])
        for i in range(n):
            a = rng.random() < 0.5
            mood = POSITIVE if a else NEGATIVE
            writer.writerow([i, _varied_sentence(rng, mood), _varied_sentence(rng, mood), -1 if test else int(a)])
    return path


def make_glue_inputs(root: Path, kind: str = "bert") -> dict:
    root.mkdir(parents=True, exist_ok=True)
    return {"model": make_model(kind, root / kind), "train": make_glue_csv(root / "train.csv", 64, 0),
            "validation": make_glue_csv(root / "dev.csv", 12, 1), "test": make_glue_csv(root / "test.csv", 8, 2, test=True)}
