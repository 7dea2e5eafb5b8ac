"""Running the AWS-template-style scripts of tests/fixtures/aws_style as `smp-adapter launch --cpu`
runs them, and their single-process references (plain PyTorch + transformers on the same model,
initial weights, global batches, optimizer and clipping).

Two ways, the same script, arguments and environment:
* ``run_ok``: the whole `smp-adapter launch` (its supervisor, torchrun, fresh rank processes);
* ``run_forked_ok``: what `smp-adapter launch --dry-run` prints (the environment it sets for the ranks
  and the script's command line, apex shim and CUDA on CPU ranks included) given to ranks forked from
  the test process's job server (launch_util.run_as_launched says why). The launcher's own part is run
  whole by the sdp test and the BERT apex test here, and by test_launch.py and the others it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from launch_util import MAIN, ROOT, base_env, run_as_launched

FIXTURES = ROOT / "tests/fixtures/aws_style"


def make_tokens(path: Path, samples: int = 64, seq: int = 16, vocab: int = 64) -> Path:
    """Learnable sequences: x_t = (a + b t) mod vocab for random a, b (fixed seed)."""
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, vocab, (samples, 1), generator=g)
    b = torch.randint(1, 5, (samples, 1), generator=g)
    tokens = (a + b * torch.arange(seq)) % vocab
    path.mkdir(parents=True, exist_ok=True)
    torch.save(tokens, path / "tokens.pt")
    return path


def launch(script: Path, nprocs: int, args: dict, run_dir: Path, channels: dict | None = None, timeout: int = 400,
           extra: tuple = ()) -> subprocess.CompletedProcess:
    """`smp-adapter launch --cpu --launcher torchrun --nproc-per-node N [--channel ...] script --k v ...`
    (the script's own arguments: smp options are built by the script itself, as the AWS templates do).
    torchrun, not the default deepspeed launcher: these tests are about the scripts, and the deepspeed
    launcher's two extra Python processes cost about 3.7 s per job here (its own path is tested in
    test_launch.py and by the recipes)."""
    cmd = [sys.executable, "-c", MAIN, "launch", "--timeout", str(timeout - 30),
           *_launch_args(script, nprocs, args, run_dir, channels, extra)]
    return subprocess.run(cmd, env=base_env(), cwd=run_dir, capture_output=True, text=True, timeout=timeout)


def _launch_args(script: Path, nprocs: int, args: dict, run_dir: Path, channels: dict | None,
                 extra: tuple) -> list[str]:
    """`launch`'s arguments for the job: the launcher's options, then the script and its own arguments."""
    cmd = ["--cpu", "--launcher", "torchrun", "--nproc-per-node", str(nprocs), "--job-dir", str(run_dir / "job"),
           *extra]
    for name, path in (channels or {}).items():
        cmd += ["--channel", f"{name}={path}"]
    cmd.append(str(script))
    for key, value in args.items():
        cmd += [f"--{key}", str(value)]
    return cmd


def run_ok(*a, **k) -> tuple[dict, str]:
    result = launch(*a, **k)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    run_dir = a[3]
    return json.loads((run_dir / "results.json").read_text()), output


def run_forked_ok(script: Path, nprocs: int, args: dict, run_dir: Path, channels: dict | None = None,
                  timeout: int = 400, extra: tuple = ()) -> tuple[dict, str]:
    """``run_ok``'s job, its ranks forked with the environment and arguments `smp-adapter launch`
    gives them (launch_util.run_as_launched): the script's results and every rank's output."""
    output = run_as_launched(*_launch_args(script, nprocs, args, run_dir, channels, extra), cwd=run_dir,
                             timeout=timeout)
    assert "Traceback" not in output, output[-6000:]
    return json.loads((run_dir / "results.json").read_text()), output


# ---------------------------------------------------------------- GPT template reference


def gpt_reference(args: dict, data_dir: Path, data_ranks: int) -> list[float]:
    """Per-step loss that data-parallel rank 0 reports, from one process training on the whole
    global batch (train_batch_size x data_ranks rows): the same AdamW groups, clipping at
    grad_clip, constant LR. fp32, no dropout."""
    import importlib.util
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, set_seed

    spec = importlib.util.spec_from_file_location("aws_style_gpt_train", FIXTURES / "gpt/train.py")
    gpt = importlib.util.module_from_spec(spec)  # the fixture's own model_config, nothing else
    spec.loader.exec_module(gpt)

    defaults = {"model_type": "gpt2", "max_context_width": 16, "vocab_size": 64, "hidden_width": 32,
                "num_layers": 4, "num_heads": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "seed": 12345, "lr": 1e-3, "weight_decay": 0.01, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
                "train_batch_size": 4, "max_steps": 4}
    a = SimpleNamespace(**{**defaults, **{k: v for k, v in args.items() if k in defaults}})
    set_seed(a.seed)
    auto = AutoModelForSeq2SeqLM if a.model_type == "flan_t5" else AutoModelForCausalLM
    model = auto.from_config(gpt.model_config(a))
    gpt_reference.initial_norm = torch.sqrt(sum(p.detach().pow(2).sum() for p in model.parameters())).item()
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:  # tied weights (LM head = word embedding) once
                continue
            seen.add(id(p))
            (no_decay if isinstance(module, torch.nn.LayerNorm) or name == "bias" else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], betas=(a.beta1, a.beta2), lr=a.lr)
    tokens = torch.load(data_dir / "tokens.pt", weights_only=True)
    global_batch = a.train_batch_size * data_ranks
    losses = []
    model.train()
    for step in range(a.max_steps):
        rows = tokens[(step * global_batch) % len(tokens):][:global_batch]
        with torch.no_grad():  # what rank 0 reports: the loss of its own rows before the update
            mine = rows[0::data_ranks].contiguous()  # as the rank's copy on its device (T5 views labels)
            losses.append(model(input_ids=mine, labels=mine)["loss"].item())
        opt.zero_grad()
        # the mean of the data ranks' losses = the loss of the whole batch (equal token counts)
        model(input_ids=rows, labels=rows)["loss"].backward()
        if a.grad_clip > 0:
            gpt_reference.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip))
        opt.step()
    gpt_reference.final_model = model
    return losses


def make_mnist(path: Path, samples: int = 128) -> Path:
    """MNIST-shaped data that can be learnt: each class has its own bright 6x6 square plus noise."""
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 10, (samples,), generator=g)
    images = 0.3 * torch.randn(samples, 1, 28, 28, generator=g)
    for i, c in enumerate(labels.tolist()):
        r, col = 2 + 8 * (c // 4), 2 + 8 * (c % 4)
        images[i, 0, r:r + 6, col:col + 6] += 1.0
    path.mkdir(parents=True, exist_ok=True)
    torch.save((images, labels), path / "mnist.pt")
    return path


def make_bert(path: Path, samples: int = 64, seq: int = 16, vocab: int = 64) -> Path:
    """Pre-training batches: token ids with a learnable structure, 15 % of positions to predict (-1
    elsewhere), and next-sentence labels that depend on the segment split."""
    g = torch.Generator().manual_seed(11)
    start = torch.randint(4, vocab, (samples, 1), generator=g)
    input_ids = (start + torch.arange(seq)) % (vocab - 4) + 4
    split = torch.randint(4, seq - 4, (samples,), generator=g)
    segment_ids = (torch.arange(seq) >= split[:, None]).long()
    input_mask = torch.ones(samples, seq, dtype=torch.long)
    chosen = torch.rand(samples, seq, generator=g) < 0.15
    mlm_labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -1))
    input_ids = torch.where(chosen, torch.full_like(input_ids, 3), input_ids)  # [MASK] = 3
    nsp_labels = (split > seq // 2).long()
    path.mkdir(parents=True, exist_ok=True)
    torch.save((input_ids, segment_ids, input_mask, mlm_labels, nsp_labels), path / "bert.pt")
    return path


def bert_reference(data_dir: Path, data_ranks: int, microbatches: int, steps: int = 4, lr: float = 4e-3) -> list[float]:
    """What data-parallel rank 0 reports (mean of its microbatch losses) from one process training
    on the whole global batch with the same FusedLAMB, groups and schedule."""
    import importlib.util

    from smdistributed.modelparallel.torch.optimizers import FusedLAMB

    spec = importlib.util.spec_from_file_location("aws_style_bert", FIXTURES / "bert/pretrain.py")
    bert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bert)
    torch.manual_seed(42)
    from transformers import BertForPreTraining

    model = BertForPreTraining(bert.bert_config())
    opt = FusedLAMB(bert.grouped_parameters(model.named_parameters()), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: bert.poly_warmup(s, 1, steps))
    criterion = bert.PretrainingCriterion(model.config.vocab_size)
    data = torch.load(data_dir / "bert.pt", weights_only=True)
    global_batch, losses = 8 * data_ranks, []
    model.train()
    for step in range(steps):
        total, mine = 0.0, []
        for rank in range(data_ranks):
            rows = [t[step * global_batch + rank:(step + 1) * global_batch:data_ranks].contiguous() for t in data]
            for chunk in zip(*(r.chunk(microbatches) for r in rows)):
                out = model(input_ids=chunk[0], token_type_ids=chunk[1], attention_mask=chunk[2])
                loss = criterion(out.prediction_logits, out.seq_relationship_logits, chunk[3], chunk[4])
                # smp: the microbatch average on each rank, then the average over data-parallel ranks
                (loss / (microbatches * data_ranks)).backward()
                if rank == 0:
                    mine.append(loss.item())
        losses.append(sum(mine) / len(mine))
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses
