"""A GLUE-style sequence-classification fine-tune as Hugging Face's examples write it (the way
transformers' own SageMaker model-parallel tests drive smp): ``HfArgumentParser`` over model, data
and ``TrainingArguments`` dataclasses, CSV files, ``Trainer`` with ``do_train`` / ``do_eval`` /
``do_predict``. No smp code at all: launched with smp options (``smp-adapter launch`` puts
``partitions`` in ``SM_HP_MP_PARAMETERS`` and ``sagemaker_mpi_enabled`` in ``SM_FRAMEWORK_PARAMS``),
transformers' Trainer takes its SageMaker model-parallel path and drives smp itself.

    smp-adapter launch --cpu --options '{"pipeline_parallel_degree": 2, "microbatches": 2}' run_glue.py \\
        --model_name_or_path MODEL_DIR --train_file train.csv --validation_file dev.csv --test_file test.csv \\
        --do_train --do_eval --do_predict --output_dir out --per_device_train_batch_size 8

CSV files: a ``label`` column (integers or names; in the test file it is left out, as transformers' own
``run_glue.py`` removes it before ``predict``) and one or two text
columns (``sentence`` or ``sentence1``/``sentence2``, as GLUE's tasks). The model directory holds a
config, weights and a tokenizer (``save_pretrained``). Rank 0 writes ``train_losses.json`` and
``train_grad_norms.json`` (the loss and gradient norm logged at each logging step), ``eval_results.json``, ``test_logits.json`` and ``test_predictions.csv`` into
``output_dir``.
"""

import csv
import json
import logging
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser, Trainer,
                          TrainingArguments, default_data_collator, set_seed)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local model directory (config, weights, tokenizer)"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "tokenizer directory, if not the model's"})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "CSV with the training examples"})
    validation_file: str | None = field(default=None, metadata={"help": "CSV with the evaluation examples"})
    test_file: str | None = field(default=None, metadata={"help": "CSV with the examples to predict"})
    max_seq_length: int = field(default=32, metadata={"help": "sequences are padded or cut to this length"})


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def text_columns(rows: list[dict]) -> tuple[str, str | None]:
    columns = [c for c in rows[0] if c not in ("label", "idx")]
    if "sentence1" in columns and "sentence2" in columns:
        return "sentence1", "sentence2"
    if "sentence" in columns:
        return "sentence", None
    if not columns:
        raise SystemExit(f"the CSV has no text column (found {list(rows[0])}): name it sentence, or sentence1 and sentence2")
    return columns[0], (columns[1] if len(columns) > 1 else None)


class Encoded(torch.utils.data.Dataset):
    def __init__(self, rows, tokenizer, max_len, label_ids):
        first, second = text_columns(rows)
        texts = ([r[first] for r in rows],) + (([r[second] for r in rows],) if second else ())
        self.enc = tokenizer(*texts, padding="max_length", truncation=True, max_length=max_len)
        self.labels = [label_ids[r["label"]] for r in rows] if "label" in rows[0] else None

    def __len__(self):
        return len(self.enc["input_ids"])

    def __getitem__(self, i):
        item = {k: torch.tensor(v[i]) for k, v in self.enc.items()}
        if self.labels is not None:
            item["labels"] = torch.tensor(self.labels[i])
        return item


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO
                        if training_args.should_log else logging.WARN)
    set_seed(training_args.seed)

    splits = {name: read_csv(path) for name, path in (("train", data_args.train_file), ("validation",
              data_args.validation_file), ("test", data_args.test_file)) if path}
    if "test" in splits:  # predicted without labels, as transformers' run_glue does (remove_columns("label"))
        splits["test"] = [{k: v for k, v in row.items() if k != "label"} for row in splits["test"]]
    labeled = [rows for name, rows in splits.items() if name != "test"]
    if not labeled:
        raise SystemExit("give --train_file or --validation_file (CSV with a label column)")
    label_list = sorted({r["label"] for rows in labeled for r in rows})
    label_ids = {label: i for i, label in enumerate(label_list)}

    config = AutoConfig.from_pretrained(model_args.model_name_or_path, num_labels=len(label_list))
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path, config=config)
    datasets = {name: Encoded(rows, tokenizer, data_args.max_seq_length, label_ids) for name, rows in splits.items()}

    def compute_metrics(p):
        preds = np.argmax(p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions, axis=1)
        return {"accuracy": float((preds == p.label_ids).mean())}

    trainer = Trainer(model=model, args=training_args, train_dataset=datasets.get("train"),
                      eval_dataset=datasets.get("validation"), compute_metrics=compute_metrics,
                      data_collator=default_data_collator)
    out = training_args.output_dir
    if training_args.do_train:
        result = trainer.train()
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        if trainer.is_world_process_zero():
            tokenizer.save_pretrained(out)
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            with open(os.path.join(out, "train_losses.json"), "w") as f:
                json.dump(losses, f)
            norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
            with open(os.path.join(out, "train_grad_norms.json"), "w") as f:
                json.dump(norms, f)
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        if trainer.is_world_process_zero():
            with open(os.path.join(out, "eval_results.json"), "w") as f:
                json.dump(metrics, f)
    if training_args.do_predict:
        logits = trainer.predict(datasets["test"]).predictions
        logits = logits[0] if isinstance(logits, tuple) else logits
        predictions = np.argmax(logits, axis=1)
        if trainer.is_world_process_zero():
            with open(os.path.join(out, "test_logits.json"), "w") as f:
                json.dump(np.asarray(logits, dtype=np.float64).tolist(), f)
            with open(os.path.join(out, "test_predictions.csv"), "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["index", "prediction"])
                writer.writerows((i, label_list[p]) for i, p in enumerate(predictions))


if __name__ == "__main__":
    main()
