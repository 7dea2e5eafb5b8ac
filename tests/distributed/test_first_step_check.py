"""The first-step check the data-parallel tests use (common.assert_first_step_matches), on runs made in
one process: it accepts data parallelism done right (two half-batch gradients averaged, the order a
2-rank run sums in) and rejects it done wrong, so its per-element tolerance hides no real bug."""

import pytest
import torch
from common import assert_first_step_matches, first_step_reference, make_optimizer, tiny_vit

GLOBAL = 8
LR = {"sgd": 0.1, "adam": 1e-3}  # as in test_data_parallel.py


@pytest.fixture(scope="module")
def init_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "init.pt"
    torch.save(tiny_vit().state_dict(), path)
    return str(path)


def _step_with_gradients(init_weights, grads, optimizer):
    model = tiny_vit()
    model.load_state_dict(torch.load(init_weights, weights_only=True))
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    make_optimizer(model.parameters(), optimizer, LR[optimizer]).step()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def _rank_gradients(init_weights, optimizer, rank):
    half = GLOBAL // 2
    _, grads, _ = first_step_reference(init_weights, GLOBAL, optimizer, LR[optimizer],
                                       rows=slice(rank * half, (rank + 1) * half))
    return grads


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accepts_two_ranks_averaged_gradients(init_weights, optimizer):
    g0, g1 = (_rank_gradients(init_weights, optimizer, r) for r in (0, 1))
    averaged = {name: (g0[name] + g1[name]) / 2 for name in g0}
    assert_first_step_matches(_step_with_gradients(init_weights, averaged, optimizer), init_weights, GLOBAL,
                              optimizer, LR[optimizer])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_rejects_gradients_never_averaged_across_ranks(init_weights, optimizer):
    local = _rank_gradients(init_weights, optimizer, 0)  # rank 0 steps on its own half batch
    with pytest.raises(AssertionError, match=r"first-step parameters differ from one plain-PyTorch step:\n"
                                             r".*elements beyond their tolerance; worst at flat index"):
        assert_first_step_matches(_step_with_gradients(init_weights, local, optimizer), init_weights, GLOBAL,
                                  optimizer, LR[optimizer])


def test_rejects_summed_instead_of_averaged_gradients(init_weights):
    _, summed, _ = first_step_reference(init_weights, GLOBAL, "sgd", LR["sgd"], grad_scale=2.0)
    with pytest.raises(AssertionError, match=r"elements beyond their tolerance"):
        assert_first_step_matches(_step_with_gradients(init_weights, summed, "sgd"), init_weights, GLOBAL, "sgd",
                                  LR["sgd"])
