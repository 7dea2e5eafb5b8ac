"""A GLUE fine-tune written the way transformers' own SageMaker model-parallel test script is (its
``tests/sagemaker`` suite launches it with smp options ``partitions``/``microbatches``/``ddp``): Hugging
Face ``datasets`` read the CSV files and ``map`` the tokenizer over them (the text, ``idx`` and ``label``
columns stay, and the Trainer drops those the model does not take), padding to ``max_seq_length`` or,
with ``--pad_to_max_length False``, per batch by the Trainer's default collator (batch shapes change from
step to step); training resumes from the output directory's last checkpoint, saves the model, metrics and state,
evaluates, and predicts on the test split after ``remove_columns("label")`` (GLUE's test labels are -1).

Written for the tests (no code of the public script): beside what the public script writes it dumps
the predicted logits (``test_logits.json``) so that a test can compare them with one process."""

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import transformers
from datasets import load_dataset
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, EvalPrediction,
                          HfArgumentParser, PretrainedConfig, Trainer, TrainingArguments, default_data_collator,
                          set_seed)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "CSV of the training rows (a label column)"})
    validation_file: str = field(metadata={"help": "CSV of the evaluation rows"})
    test_file: str | None = field(default=None, metadata={"help": "CSV of the rows to predict (label -1)"})
    max_seq_length: int = field(default=32)
    pad_to_max_length: bool = field(default=True, metadata={"help": "False: pad per batch"})
    max_train_samples: int | None = field(default=None)
    overwrite_cache: bool = field(default=False)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a model directory"})
    tokenizer_name: str | None = field(default=None)


def parse_args():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    return parser.parse_args_into_dataclasses()


def last_checkpoint_of(training_args):
    out = training_args.output_dir
    if not (os.path.isdir(out) and training_args.do_train and not getattr(training_args, "overwrite_output_dir", False)):
        return None
    found = get_last_checkpoint(out)
    if found is None and len(os.listdir(out)) > 0:
        raise ValueError(f"Output directory ({out}) already exists and is not empty.")
    return found


def sentence_keys(column_names):
    names = [name for name in column_names if name not in ("label", "idx")]
    if "sentence1" in names and "sentence2" in names:
        return "sentence1", "sentence2"
    return (names[0], names[1]) if len(names) >= 2 else (names[0], None)


def main():
    model_args, data_args, training_args = parse_args()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO
                        if training_args.should_log else logging.WARN)
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_warning()
    last_checkpoint = last_checkpoint_of(training_args)
    set_seed(training_args.seed)

    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if training_args.do_predict:
        data_files["test"] = data_args.test_file
    raw = load_dataset("csv", data_files=data_files)
    label_list = sorted(raw["train"].unique("label"))
    num_labels = len(label_list)

    config = AutoConfig.from_pretrained(model_args.model_name_or_path, num_labels=num_labels)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path, config=config)

    first, second = sentence_keys(raw["train"].column_names)
    padding = "max_length" if data_args.pad_to_max_length else False
    label_to_id = None
    if model.config.label2id == PretrainedConfig(num_labels=num_labels).label2id:
        label_to_id = {v: i for i, v in enumerate(label_list)}

    def preprocess(examples):
        texts = (examples[first],) if second is None else (examples[first], examples[second])
        result = tokenizer(*texts, padding=padding, max_length=data_args.max_seq_length, truncation=True)
        if label_to_id is not None and "label" in examples:
            result["label"] = [label_to_id[x] if x != -1 else -1 for x in examples["label"]]
        return result

    datasets = raw.map(preprocess, batched=True, load_from_cache_file=not data_args.overwrite_cache)
    train_dataset = datasets["train"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(data_args.max_train_samples))

    def compute_metrics(p: EvalPrediction):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        return {"accuracy": (np.argmax(preds, axis=1) == p.label_ids).astype(np.float32).mean().item()}

    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset if training_args.do_train else None,
                      eval_dataset=datasets["validation"] if training_args.do_eval else None,
                      compute_metrics=compute_metrics, processing_class=tokenizer,
                      data_collator=default_data_collator if data_args.pad_to_max_length else None)

    if training_args.do_train:
        # The public script also "resumes" from a model directory. transformers 4.57 and 5.x read a
        # trainer_state.json from any folder they resume from, so that fails on one process without smp: left out.
        result = trainer.train(resume_from_checkpoint=last_checkpoint)
        metrics = dict(result.metrics, train_samples=len(train_dataset))
        trainer.save_model()
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate(eval_dataset=datasets["validation"])
        metrics["eval_samples"] = len(datasets["validation"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        test_dataset = datasets["test"].remove_columns("label")  # GLUE's test labels are -1
        logits = trainer.predict(test_dataset=test_dataset).predictions
        logits = logits[0] if isinstance(logits, tuple) else logits
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "test_results.txt"), "w") as writer:
                writer.write("index\tprediction\n")
                for index, item in enumerate(np.argmax(logits, axis=1)):
                    writer.write(f"{index}\t{label_list[item]}\n")
            with open(os.path.join(training_args.output_dir, "test_logits.json"), "w") as f:
                json.dump(np.asarray(logits, dtype=np.float64).tolist(), f)


if __name__ == "__main__":
    main()
