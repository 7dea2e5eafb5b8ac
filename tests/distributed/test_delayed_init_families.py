"""Delayed parameter initialisation x tensor parallelism 2 x sharded data parallel 2 (4 ranks), for
every model family mapped for tensor parallelism (GPT-2, GPT-J, GPT-Neo, GPT-NeoX, Llama, Mistral,
Qwen2, BERT, RoBERTa, ViT, T5, Falcon): right after smp.DistributedModel each rank's tensors (ZeRO-3
shards gathered) against the same model built without delayed initialisation. One job builds all
families in turn (scripts/delayed_init_families.py says what is compared and why).

Before the fix, a ZeRO group without global rank 0 broadcast uninitialised memory (transformers
initialises on ``get_rank() == 0``): the AWS GPT-J template trained on NaN at this layout."""

from launch_util import ROOT, run_ranks

FAMILIES = ["gpt2", "gptj", "gptneo", "gpt_neox", "llama", "mistral", "qwen2", "bert", "roberta", "vit", "t5",
            "falcon"]


def test_every_tp_family_is_initialised_under_delayed_init_tp2_sdp2(tmp_path):
    results = run_ranks(ROOT / "tests/distributed/scripts/delayed_init_families.py", 4, args=[",".join(FAMILIES)],
                        out_dir=tmp_path, timeout=300)
    for rank, result in enumerate(results):
        assert sorted(result["problems"]) == sorted(FAMILIES)
        assert {f: p for f, p in result["problems"].items() if p} == {}, f"rank {rank}"
