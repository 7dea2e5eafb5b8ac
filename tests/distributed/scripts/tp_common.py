"""Models and data of the tensor-parallel test scripts, shared with their references."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """The seed's conv + linear net, at a smaller input (1x12x12 images -> fc1 1024 -> 32)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(256, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), 1)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(7)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def batch_for(model: str, step: int, size: int):
    g = torch.Generator().manual_seed(500 + step)
    if model == "convnet":
        return torch.randn(size, 1, 12, 12, generator=g), torch.randint(0, 8, (size,), generator=g)
    ids = torch.randint(0, 64, (size, 12), generator=g)
    return ids, ids


def reference(model_name: str, steps: int, global_size: int, init_state: dict, clip=None):
    model = Net() if model_name == "convnet" else tiny_gpt2()
    model.load_state_dict(init_state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        data, target = batch_for(model_name, step, global_size)
        opt.zero_grad()
        if model_name == "convnet":
            loss = F.nll_loss(model(data), target)
        else:
            loss = model(input_ids=data, labels=data)["loss"]
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()
