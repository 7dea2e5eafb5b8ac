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


class TinyConvNet(nn.Module):
    """A conv net for the same 8x8 images: 4-D conv weights and BatchNorm (a persistent buffer each
    for running mean, variance and batch count). Returns {"logits": ...} like the ViT."""

    def __init__(self, num_labels: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16 * 4 * 4, num_labels)

    def forward(self, pixel_values):
        return {"logits": self.head(self.features(pixel_values).flatten(1))}


def tiny_cnn():
    torch.manual_seed(1234)
    return TinyConvNet()


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


ADAM_EPS = 1e-8  # torch.optim.Adam's default, which make_optimizer uses


def first_step_reference(init_weights, global_size: int, optimizer: str, lr: float, dtype=torch.float32,
                         rows: slice = slice(None), grad_scale: float = 1.0):
    """One plain-PyTorch step of tiny_vit on step 0's global batch, in ``dtype``: parameters before,
    gradients, parameters after. ``rows`` and ``grad_scale`` build *wrong* runs for the check's own
    tests: one rank's rows only (gradients never averaged across ranks) or a summed gradient."""
    model = tiny_vit().to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in torch.load(init_weights, weights_only=True).items()})
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    images, labels = global_batch(0, global_size)
    nn.CrossEntropyLoss()(model(images[rows].to(dtype))["logits"], labels[rows]).backward()
    grads = {}
    for name, p in model.named_parameters():
        p.grad.mul_(grad_scale)
        grads[name] = p.grad.detach().clone()
    make_optimizer(model.parameters(), optimizer, lr).step()
    return before, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _update_direction(optimizer: str, g: torch.Tensor) -> torch.Tensor:
    """A first step moves each parameter by -lr * this. SGD: g. Adam: m_hat / (sqrt(v_hat) + eps) with
    m_hat = g and v_hat = g^2 after bias correction, i.e. g / (|g| + eps)."""
    return g if optimizer == "sgd" else g / (g.abs() + ADAM_EPS)


def assert_first_step_matches(params_after, init_weights, global_size: int, optimizer: str, lr: float):
    """The parameters a distributed run holds after its first step equal one plain-PyTorch step on the
    whole global batch, element by element, within a tolerance each element earns:

    * 1e-5 relative + 1e-6 absolute on the parameter, for the rounding of p - lr * update;
    * plus how far the element's update can move when its gradient moves by its fp32 rounding. A
      distributed run sums the same per-sample terms in another order (halves per rank, then an
      all-reduce), so its gradient differs from the single-process one by rounding. The rounding of
      each element is measured: |fp32 gradient - float64 gradient|, times 4 (two fp32 orders each
      deviate from the exact sum by about that much, with margin), and at least the tensor's mean
      rounding. For SGD that term is tiny (lr * rounding). For Adam it is what matters: its first step is
      about lr * sign(g), so an element whose exact gradient is zero (attention key biases: softmax
      ignores a shift shared by all keys) and whose fp32 gradient is rounding noise may move by up to
      2 * lr, on any machine, in any correct run; elements with a real gradient stay tight.

    What it still catches: a gradient not averaged across ranks, or summed instead of averaged, moves
    elements with real gradients far beyond their rounding (tests/distributed/test_first_step_check.py
    shows the check failing for each; for Adam only the first, since Adam's step ignores the gradient's
    scale)."""
    before, g32, after32 = first_step_reference(init_weights, global_size, optimizer, lr)
    _, g64, _ = first_step_reference(init_weights, global_size, optimizer, lr, dtype=torch.float64)
    problems = []
    for name, expected in after32.items():
        actual = torch.as_tensor(params_after[name], dtype=expected.dtype).reshape(expected.shape)
        allowed = 1e-5 * expected.abs() + 1e-6
        if name in g32:
            g = g32[name].double()
            rounding = (g - g64[name]).abs()
            delta = 4 * torch.maximum(rounding, rounding.mean().expand_as(rounding))
            f = _update_direction(optimizer, g)
            moved = torch.maximum((_update_direction(optimizer, g + delta) - f).abs(),
                                  (_update_direction(optimizer, g - delta) - f).abs())
            allowed = allowed + (lr * moved).to(expected.dtype)
        excess = (actual - expected).abs() - allowed
        if (excess > 0).any():
            i = int(excess.flatten().argmax())
            problems.append(f"{name}: {int((excess > 0).sum())} of {expected.numel()} elements beyond their "
                            f"tolerance; worst at flat index {i}: got {actual.flatten()[i].item():.9g}, expected "
                            f"{expected.flatten()[i].item():.9g}, allowed +-{allowed.flatten()[i].item():.3g}")
    assert not problems, "first-step parameters differ from one plain-PyTorch step:\n" + "\n".join(problems)
