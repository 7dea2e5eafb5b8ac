"""Sequence-classification fine-tune of a BERT-family encoder, written against the smp v1 API.
Default task (no network): does the generated sentence's subject own a pet (cat/dog)? Real runs
pass --model_name_or_path and --dataset (a file of `label<TAB>text` lines)."""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import recipe_utils as ru  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model_name_or_path", default=None)
p.add_argument("--dataset", default=None)
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--n_layer", type=int, default=2)
p.add_argument("--steps", type=int, default=80)
p.add_argument("--per_rank_batch", type=int, default=16)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--seq_len", type=int, default=16)
p.add_argument("--run_dir", default=os.environ.get("SM_MODEL_DIR", "runs/classification"))
args, _ = p.parse_known_args()

smp.init()
run_dir = Path(args.run_dir)
if smp.rank() == 0:
    run_dir.mkdir(parents=True, exist_ok=True)
smp.barrier()
if args.dataset:
    pairs = [line.split("\t", 1) for line in Path(args.dataset).read_text().splitlines() if "\t" in line]
    labels, texts = [int(a) for a, _ in pairs], [b for _, b in pairs]
else:
    texts = ru.make_corpus(4000, seed=1)
    labels = [int(t.startswith(("the cat", "a dog"))) for t in texts]

from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, BertForSequenceClassification  # noqa: E402,E501

if args.model_name_or_path:
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
else:
    if smp.rank() == 0:
        ru.train_tokenizer(texts, 200, run_dir / "tokenizer")
    smp.barrier()
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(run_dir / "tokenizer")
enc = tokenizer(texts, padding="max_length", truncation=True, max_length=args.seq_len, return_tensors="pt")
ids, mask, y = enc["input_ids"], enc["attention_mask"], torch.tensor(labels)

torch.manual_seed(0)
with smp.model_creation():
    if args.model_name_or_path:
        model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, num_labels=2)
    else:
        model = BertForSequenceClassification(BertConfig(
            vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.n_layer, num_attention_heads=4,
            intermediate_size=4 * args.hidden, max_position_embeddings=args.seq_len, num_labels=2,
            pad_token_id=tokenizer.pad_token_id))
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))


@smp.step
def train_step(model, input_ids, attention_mask, labels):
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    model.backward(out["loss"])
    return out["loss"], (out["logits"].argmax(-1) == labels).float().mean()


progress = ru.Progress(args.steps, run_dir, enabled=smp.rank() == 0)
model.train()
for step in range(args.steps):
    rows = ru.batches(torch.arange(len(texts)), step, args.per_rank_batch, smp.dp_rank(), smp.dp_size(), 0)
    optimizer.zero_grad()
    loss_mb, acc_mb = train_step(model, ids[rows], mask[rows], y[rows])
    optimizer.step()
    loss = sum(smp.allgather(loss_mb.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size()
    acc = sum(smp.allgather(acc_mb.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size()
    progress.update(step + 1, loss, tokens=ids[rows].numel() * smp.dp_size(), accuracy=acc)
progress.close()
if smp.rank() == 0:
    print(f"final loss {loss:.4f}, batch accuracy {acc:.3f}")
