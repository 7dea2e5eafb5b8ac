"""Models and data of the pipeline-parallel test scripts, shared with their single-process references."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from tp_common import Net, tiny_gpt2  # the seed's conv + linear net, small


class SixLayer(nn.Module):
    """Six linear layers with activations between them (functional, not nn.Sequential)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(5)] + [nn.Linear(16, 8)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return F.log_softmax(self.layers[-1](x), 1)


class SixLayerTied(SixLayer):
    """SixLayer with layers 3 and 4 sharing one weight: at pp 2 both uses fall in stage 1, whose backward
    the split-backward schedules split (pytorch #180952: a weight used twice inside a stage counted
    twice by the weight-gradient step)."""

    def __init__(self):
        super().__init__()
        self.layers[4].weight = self.layers[3].weight


class SkipNet(nn.Module):
    """Four linear layers; the first one's output h0 is read again by the last two (values read past
    the next stage when cut into 4 stages: threaded through the stages between, float, with gradients)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)] + [nn.Linear(16, 8)])

    def forward(self, x):
        h0 = torch.tanh(self.layers[0](x))
        h = torch.tanh(self.layers[1](h0))
        h = torch.tanh(self.layers[2](h)) + h0
        return F.log_softmax(self.layers[3](h) + h0[:, :8], 1)


class GatedNet(SkipNet):
    """SkipNet's layers; a boolean mask made from the input on the first stage gates layer 2 on a later
    one: a value without gradient that a training stage receives (torch < 2.13 made every receive buffer
    require a gradient, which a boolean tensor cannot)."""

    def forward(self, x):
        keep = x[:, :1] > 0
        h = torch.tanh(self.layers[1](torch.tanh(self.layers[0](x))))
        h = torch.where(keep, torch.tanh(self.layers[2](h)), h)
        return F.log_softmax(self.layers[3](h), 1)


class GroupedNet(Net):
    """The seed's manual-partition net: Net's layers and forward, its children created inside
    smp.partition(0) / smp.partition(1)."""

    def __init__(self, smp=None):
        nn.Module.__init__(self)
        import contextlib

        part = smp.partition if smp is not None else (lambda i: contextlib.nullcontext())
        with part(0):
            self.conv1 = nn.Conv2d(1, 8, 3, 1)
            self.conv2 = nn.Conv2d(8, 16, 3, 1)
        with part(1):
            self.fc1 = nn.Linear(256, 32)
            self.fc2 = nn.Linear(32, 8)


LM_MODELS = ("gpt2", "gptneo", "gptj")  # Hugging Face causal LMs: token batches, the shifted LM loss


def tiny_gptneo():
    """GPT-Neo as the public smp templates build it: its config keeps use_cache=True (the pipeline
    traces it without the generation cache), one global and one local-attention layer."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(7)
    return GPTNeoForCausalLM(GPTNeoConfig(vocab_size=64, num_layers=2, hidden_size=32, num_heads=4,
                                          max_position_embeddings=16, attention_types=[[["global", "local"], 1]],
                                          window_size=4, resid_dropout=0.0, embed_dropout=0.0,
                                          attention_dropout=0.0, bos_token_id=0, eos_token_id=0))


def tiny_gptj():
    """GPT-J as the public smp templates build it (config use_cache=True); its first stage returns a
    non-contiguous activation (stage I/O must still be sent and received contiguous)."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(7)
    return GPTJForCausalLM(GPTJConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def build(name, smp=None):
    torch.manual_seed(42)
    if name == "net":
        return Net()
    if name == "manual":
        return GroupedNet(smp)
    if name == "six":
        return SixLayer()
    if name == "sixtied":
        return SixLayerTied()
    if name == "skip":
        return SkipNet()
    if name == "gated":
        return GatedNet()
    if name == "gptneo":
        return tiny_gptneo()
    if name == "gptj":
        return tiny_gptj()
    return tiny_gpt2()


def batch(name, step, size):
    g = torch.Generator().manual_seed(700 + step)
    if name in ("six", "sixtied", "skip", "gated"):
        return torch.randn(size, 16, generator=g), torch.randint(0, 8, (size,), generator=g)
    if name in LM_MODELS:
        ids = torch.randint(0, 64, (size, 12), generator=g)
        return ids, ids
    return torch.randn(size, 1, 12, 12, generator=g), torch.randint(0, 8, (size,), generator=g)


def make_optimizer(name, params):
    """The test scripts' optimizers: SGD (no state) or Adam (state to shard and checkpoint)."""
    return torch.optim.Adam(params, lr=1e-3) if name == "adam" else torch.optim.SGD(params, lr=0.05)


def reference(name, steps, global_size, microbatches, optimizer="sgd", dtype=None, loss_scale=1.0, clip=None,
              norms=None):
    """Single process: per step the mean over microbatches of the microbatch loss (= smp's reduce_mean).
    dtype (fp16/bf16): Apex-style mixed precision written out by hand: the model in dtype, fp32
    master copies updated by the optimizer, the loss multiplied by a static loss_scale in fp32,
    gradients accumulated over microbatches in dtype and divided by loss_scale into the masters.
    clip: global-norm clipping before each step (of the masters' gradients under dtype); the norms before
    clipping are appended to ``norms`` when given."""
    model = build(name)
    if dtype is not None:
        model.to(dtype)
        masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = make_optimizer(optimizer, masters if dtype is not None else model.parameters())
    losses = []
    for step in range(steps):
        data, target = batch(name, step, global_size)
        opt.zero_grad()
        model.zero_grad(set_to_none=True)
        mb_losses = []
        for d, t in zip(data.chunk(microbatches), target.chunk(microbatches)):
            if dtype is not None and d.is_floating_point():
                d = d.to(dtype)
            if name in LM_MODELS:
                logits = model(input_ids=d, use_cache=False)["logits"]
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), t[:, 1:].flatten())
            else:
                loss = F.nll_loss(model(d), t)
            if dtype is None:
                (loss / microbatches).backward()
            else:
                (loss.float() * (loss_scale / microbatches)).backward()
            mb_losses.append(loss.detach())
        if dtype is not None:
            for p, m in zip(model.parameters(), masters):
                m.grad = p.grad.float() / loss_scale
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(masters if dtype is not None else list(model.parameters()), clip)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        if dtype is not None:
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters):
                    p.copy_(m)
        losses.append(float(sum(mb_losses[1:], mb_losses[0]) / microbatches))  # as StepOutput.reduce_mean
    return losses, model.state_dict()
