"""The two models benchmarks/pipeline.py runs through smp's pipeline and DeepSpeed's PipelineEngine.

Each model is a top-level chain of modules (``chain_names``) that both engines cut at the same
places: smp's auto-partition picks its units among them, DeepSpeed gets the same modules as its
PipelineModule layer list. Every chain module takes one tensor and returns one, so a rank's own
modules can also be run as a plain module with no communication (the benchmark's ``stage``).

* ``gpt`` (default): GPT-2 style. ``embed`` (token + position embeddings), ``layers.i`` pre-norm
  transformer blocks (causal self-attention through scaled_dot_product_attention, GELU MLP 4 x wide),
  ``head`` (final LayerNorm + LM head over the vocabulary). Loss: cross entropy over every token.
  Sized so that a microbatch's compute on a stage is milliseconds while its activation (tokens x
  width floats) crosses in a tenth of one (see RESULTS §11.4).
* ``mlp``: ``layers.i`` Linear(width, width) + tanh, ``head`` Linear(width, 10) + log_softmax; NLL
  loss. The model of RESULTS §11-11.3.
"""

from __future__ import annotations

import copy

DEFAULTS = {"gpt": {"width": 256, "batch": 16, "layers": 8}, "mlp": {"width": 1024, "batch": 256, "layers": 8}}


def build(kind: str, width: int, layers: int, seq: int = 32, vocab: int = 512, heads: int = 4):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Dense(nn.Linear):  # the MLP's hidden layer: Linear then tanh
        def forward(self, x):
            return torch.tanh(super().forward(x))

    class LogSoftmaxHead(nn.Linear):
        def forward(self, x):
            return torch.log_softmax(super().forward(x), 1)

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)

        def forward(self, ids):
            return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (y.view(b, t, heads, c // heads).transpose(1, 2) for y in self.qkv(self.ln_1(x)).split(c, 2))
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln_2(x))))

    class LMHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

        def forward(self, x):
            return self.lm_head(self.ln_f(x))

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "gpt":
                self.embed = Embed()
                self.layers = nn.ModuleList([Block() for _ in range(layers)])
                self.head = LMHead()
            else:
                self.layers = nn.ModuleList([Dense(width, width) for _ in range(layers)])
                self.head = LogSoftmaxHead(width, 10)

        def forward(self, x):
            if kind == "gpt":
                x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    return Chain()


def chain_names(kind: str, layers: int) -> list[str]:
    """The model's top-level modules in the order forward runs them."""
    return (["embed"] if kind == "gpt" else []) + [f"layers.{i}" for i in range(layers)] + ["head"]


def loss(kind: str, output, target):
    import torch.nn.functional as F

    if kind == "gpt":
        return F.cross_entropy(output.flatten(0, 1), target.flatten())
    return F.nll_loss(output, target)


def batches(kind: str, batch: int, width: int, seq: int = 32, vocab: int = 512, count: int = 4) -> list:
    """``count`` (input, target) pairs, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1)
    if kind == "gpt":
        return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
                for _ in range(count)]
    return [(torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(count)]


def stage_input(kind: str, first: bool, microbatch, width: int):
    """What a rank's first own module receives for one microbatch: the model input on the first
    rank, else an activation of the width (one requiring its gradient, as a received one does)."""
    import torch

    if first:
        return microbatch
    shape = (*microbatch.shape, width) if kind == "gpt" else microbatch.shape
    return torch.randn(shape).requires_grad_(True)


def layer_list(model, kind: str, layers: int) -> list:
    """Copies of the chain's modules (same weights), DeepSpeed PipelineModule's layer list."""
    return [copy.deepcopy(model.get_submodule(name)) for name in chain_names(kind, layers)]


def local_chain(model, kind: str, layers: int, local_param_names) -> list[str]:
    """The chain modules whose parameters live on this rank, in forward order."""
    local = list(local_param_names)
    return [n for n in chain_names(kind, layers) if any(p.startswith(f"{n}.") for p in local)]
