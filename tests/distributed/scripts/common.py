"""Model and data shared by the distributed test scripts and their single-process references.

Data: step s uses a global batch drawn from a generator seeded with 1000 + s; data-parallel rank r
reads rows [r*B, (r+1)*B) of it, B = global batch / dp size. So the distributed run and a
single-process run over the whole global batch see the same samples.
"""

import torch
from torch import nn


def tiny_vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(1234)
    cfg = ViTConfig(image_size=8, patch_size=4, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                    intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg)


def vit_layers(model):
    # transformers 5 moved the encoder layers: vit.encoder.layer -> vit.layers
    vit = model.vit
    return vit.layers if hasattr(vit, "layers") else vit.encoder.layer


def global_batch(step: int, size: int):
    g = torch.Generator().manual_seed(1000 + step)
    images = torch.randn(size, 3, 8, 8, generator=g)
    labels = torch.randint(0, 3, (size,), generator=g)
    return images, labels


def reference_losses(steps: int, global_size: int, lr: float, optimizer: str = "sgd", init_weights=None):
    """Plain single-process PyTorch: the numbers a distributed run must reproduce."""
    model = tiny_vit()
    if init_weights:
        model.load_state_dict(torch.load(init_weights, weights_only=True))
    opt = make_optimizer(model.parameters(), optimizer, lr)
    losses, params_after_first = [], None
    loss_fn = nn.CrossEntropyLoss()
    for s in range(steps):
        x, y = global_batch(s, global_size)
        opt.zero_grad()
        loss = loss_fn(model(x)["logits"], y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if s == 0:
            params_after_first = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, params_after_first


def make_optimizer(params, name: str, lr: float):
    return torch.optim.SGD(params, lr=lr) if name == "sgd" else torch.optim.Adam(params, lr=lr)
