"""Delayed parameter initialisation starts every engine from the one-process model (issue 60): GPT-2
and a Llama, tied and untied embeddings, created by calling the class inside
smp.delay_param_initialization() or through smp.model_creation() + from_config, on ZeRO-3 (sdp 4 of
4), hpZ and MiCS (sdp 2 of 4), pp 2 and tp 2; losses of two SGD steps against plain PyTorch's in the
same process (scripts/delayed_init_start.py).

Before the fix, ZeRO-3 created the model under DeepSpeed's zero.Init, where transformers' weight
init ran on empty shards: a tied GPT-2 started from nn.Embedding's N(0, 1) embeddings (loss 577 at
n_embd 1024; 1e-2 off here), an untied one from other random numbers, and hpZ died in zero.Init.

Tolerance 1e-5: the first loss is the same model on the same rows (bit-equal or one float32 ulp of
the loss, from the sum's order over replicas); the second adds one SGD step of gradients reduced over
4 ranks in another order (~1e-7 at these sizes)."""

from launch_util import ROOT, run_ranks

LAYOUTS = ("zero3", "hpz", "mics", "pp2", "tp2")
ENGINES = {"zero3": "deepspeed, ZeRO stage 3, hpZ partition 1", "hpz": "deepspeed, ZeRO stage 3, hpZ partition 2",
           "mics": "mics", "pp2": "pipeline", "tp2": "deepspeed"}


def test_delayed_init_starts_from_the_one_process_weights_on_every_engine(tmp_path):
    results = run_ranks(ROOT / "tests/distributed/scripts/delayed_init_start.py", 4, args=[",".join(LAYOUTS)],
                        out_dir=tmp_path, timeout=600)
    losses = results[0]["losses"]
    assert {key.split("/")[0] for key in losses} == set(LAYOUTS)
    assert len(losses) == 2 * 4 + 3 * 2
    for key, run in losses.items():
        assert run["engine"].startswith(ENGINES[key.split("/")[0]]), (key, run["engine"])
        assert len(run["smp"]) == len(run["reference"]) == 2
        diffs = [abs(a - b) for a, b in zip(run["smp"], run["reference"])]
        assert max(diffs) < 1e-5, (key, run)
    for rank, result in enumerate(results[1:], 1):  # every rank reports the same losses
        assert {k: r["smp"] for k, r in result["losses"].items()} == {k: r["smp"] for k, r in losses.items()}, rank
