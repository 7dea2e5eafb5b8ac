"""Causal-LM training (a fine-tune with --model_name_or_path) written against the smp v1 API (runs unchanged on SageMaker smp v1 or
on smp-adapter). Default: a tiny GPT-2 (or Llama) built from its config class, a tokenizer trained
on a generated corpus, sharded data parallel; a real job passes --model_name_or_path / --dataset.

Batch arithmetic: every data-parallel rank feeds `per_rank_batch` sequences of `seq_len` tokens to
the step function, split into `microbatches`; global batch = per_rank_batch x dp_size sequences.
Outputs in --run_dir: metrics.jsonl, summary.json, checkpoints/, hf_model/ (save_pretrained format).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import recipe_utils as ru  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model_family", default="gpt2", choices=["gpt2", "llama"])
p.add_argument("--model_name_or_path", default=None, help="a Hugging Face model name or local path (real runs)")
p.add_argument("--n_layer", type=int, default=2)
p.add_argument("--hidden", type=int, default=64)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--seq_len", type=int, default=32)
p.add_argument("--vocab_size", type=int, default=256)
p.add_argument("--dataset", default=None, help="a text file or a Hugging Face dataset name")
p.add_argument("--corpus_lines", type=int, default=3000)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--per_rank_batch", type=int, default=8)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--checkpoint_every", type=int, default=0)
p.add_argument("--resume", action="store_true")
p.add_argument("--prompt", default="the cat sees")
p.add_argument("--run_dir", default=os.environ.get("SM_MODEL_DIR", "runs/causal_lm"))
args, _unknown = p.parse_known_args()  # SageMaker also passes --mp_parameters; tolerate extras

smp.init()
if torch.cuda.is_available():
    torch.cuda.set_device(smp.local_rank())
run_dir = Path(args.run_dir)
if smp.rank() == 0:
    run_dir.mkdir(parents=True, exist_ok=True)
smp.barrier()

# -- data and tokenizer: built on rank 0, read by everyone ------------------------------------------
texts = ru.load_texts(args.dataset, args.corpus_lines, args.seed)
tok_dir = run_dir / "tokenizer"
if args.model_name_or_path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
else:
    if smp.rank() == 0:
        ru.train_tokenizer(texts, args.vocab_size, tok_dir)
    smp.barrier()
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
blocks = ru.token_blocks(texts, tokenizer, args.seq_len)

# -- model ---------------------------------------------------------------------------------------------
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig  # noqa: E402

if args.model_name_or_path:
    config = AutoConfig.from_pretrained(args.model_name_or_path)
elif args.model_family == "gpt2":
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=args.hidden, n_layer=args.n_layer,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
else:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.n_layer, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=args.seq_len, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

torch.manual_seed(args.seed)
with smp.model_creation(tensor_parallelism=smp.tp_size() > 1):
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        model = AutoModelForCausalLM.from_config(config)
model = smp.DistributedModel(model)
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0))


@smp.step
def train_step(model, input_ids):
    # next-token loss from the logits (what HF computes for labels=input_ids); computing it here
    # rather than passing labels= keeps the model's inputs the same on every pipeline stage
    logits = model(input_ids=input_ids, use_cache=False)["logits"]  # no KV cache while training
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))
    model.backward(loss)
    return loss


first_step = 0
if args.resume and (run_dir / "checkpoints" / "newest").exists():
    first_step = smp.resume_from_checkpoint(str(run_dir / "checkpoints"))["step"]

progress = ru.Progress(args.steps - first_step, run_dir, enabled=smp.rank() == 0)
model.train()
for step in range(first_step, args.steps):
    input_ids = ru.batches(blocks, step, args.per_rank_batch, smp.dp_rank(), smp.dp_size(), args.seed)
    optimizer.zero_grad()
    loss = train_step(model, input_ids).reduce_mean()
    optimizer.step()
    # log the loss of the whole global batch (mean over data-parallel ranks)
    loss = sum(smp.allgather(loss.item(), smp.DP_GROUP)) / smp.dp_size()
    progress.update(step + 1, loss, tokens=input_ids.numel() * smp.dp_size(), lr=args.lr)
    if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
        smp.save_checkpoint(str(run_dir / "checkpoints"), tag=f"step{step + 1}", partial=True,
                            user_content={"step": step + 1}, num_kept_partial_checkpoints=2)
progress.close()

# -- full Hugging Face checkpoint, a generation, the summary -------------------------------------------
full_state = model.state_dict()  # collective under sharded data parallel: every rank calls it
peaks = smp.allgather(ru.peak_rss_mib(), smp.WORLD)
if smp.rank() == 0:
    hf_dir = run_dir / "hf_model"
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(full_state)
    plain.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    prompt = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        generated = reloaded.generate(**prompt, max_new_tokens=16, do_sample=False, synced_gpus=False,
                                      pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(generated[0], skip_special_tokens=True)
    # step times are metrics.jsonl's (one timer): smp-adapter report averages them
    summary = {"final_loss": loss, "steps": args.steps, "dp_size": smp.dp_size(), "world_size": smp.size(),
               "options": smp.state.cfg.to_dict(), "layout": smp.state.dims.describe(),
               "peak_rss_mib_per_rank": peaks, "generation": text, "hf_model": str(hf_dir)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"final loss {loss:.4f}; generation: {text!r}")
    print(f"Hugging Face checkpoint: {hf_dir} (AutoModelForCausalLM.from_pretrained loads it)")
smp.barrier()
