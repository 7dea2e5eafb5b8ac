"""An ordinary Hugging Face Trainer fine-tune: no smp code at all. Launched with smp options that
contain `partitions` (and SM_FRAMEWORK_PARAMS with sagemaker_mpi_enabled, which smp-adapter launch
sets), transformers' Trainer takes its SageMaker model-parallel path and drives smp (smp.init,
DistributedModel, @smp.step, DistributedOptimizer) - here carried out by smp-adapter. transformers
builds torch.device("cuda", smp.local_rank()) on that path: on a machine without GPUs, smp-adapter
launch's CUDA-on-CPU ranks stand in (docs/launch.md). transformers 5.x never creates the optimizer on
that path; smp-adapter restores that step (compat/hf_transformers.py)."""

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import recipe_utils as ru  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--run_dir", default=os.environ.get("SM_MODEL_DIR", "runs/hf_trainer"))
args, _ = p.parse_known_args()

texts = ru.make_corpus(2000, seed=0)
tok_dir = Path(args.run_dir) / "tokenizer"
tokenizer = ru.train_tokenizer(texts, 256, tok_dir)
blocks = ru.token_blocks(texts, tokenizer, 32)


class Blocks(torch.utils.data.Dataset):
    def __len__(self):
        return len(blocks)

    def __getitem__(self, i):
        return {"input_ids": blocks[i], "labels": blocks[i]}


model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=64, n_layer=2, n_head=4))
training_args = TrainingArguments(output_dir=args.run_dir, per_device_train_batch_size=8, max_steps=args.steps,
                                  learning_rate=3e-3, logging_steps=5, save_strategy="no", report_to=[])
trainer = Trainer(model=model, args=training_args, train_dataset=Blocks())
result = trainer.train()
trainer.save_model(args.run_dir)
print(f"final training loss {result.training_loss:.4f}")
