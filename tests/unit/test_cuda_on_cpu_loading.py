"""CUDA on CPU ranks never change what a model loads: ``from_pretrained`` of tiny BERT-, GPT-2- and
Llama-style models in a process with the mode installed (``SMP_ADAPTER_CUDA_ON_CPU=1`` and the smp
import, as launch --cpu runs a script) gives the parameters and buffers, non-persistent ones
included (BERT's position_ids / token_type_ids, Llama's rotary inv_freq), bit-equal to this process,
which has no mode. transformers 5 creates the model inside ``with torch.device("meta")`` and
re-creates the non-persistent buffers with ``torch.empty_like``; with the factories wrapped before
torch built its list of device-taking factories, they stayed uninitialised (values around 1e18)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LOAD = """
import sys, torch
import smdistributed.modelparallel.torch  # installs the mode (SMP_ADAPTER_CUDA_ON_CPU=1)
from smp_adapter.compat import cuda_on_cpu
assert cuda_on_cpu._installed, "the mode was not installed"
with torch.device("meta"):  # what transformers relies on, alone: the device context reaches the factories
    made = {"zeros": torch.zeros(2), "arange": torch.arange(2), "empty": torch.empty(2), "tensor": torch.tensor([1.0])}
not_meta = [name for name, t in made.items() if not t.is_meta]
assert not not_meta, f"not created on meta inside torch.device('meta'): {not_meta}"
from transformers import AutoModel
out = {}
for name in sys.argv[2:]:
    model = AutoModel.from_pretrained(f"{sys.argv[1]}/{name}")
    out[name] = {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
torch.save(out, f"{sys.argv[1]}/loaded.pt")
"""


def _tiny_models(root: Path) -> list[str]:
    import torch
    from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM)

    torch.manual_seed(0)
    models = {
        "bert": BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=32,
                                                         max_position_embeddings=32)),
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)),
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                              max_position_embeddings=32)),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
    return list(models)


def test_from_pretrained_loads_the_same_tensors_with_the_mode(tmp_path):
    import torch
    from transformers import AutoModel

    from smp_adapter.compat import cuda_on_cpu

    assert not cuda_on_cpu._installed  # this process is the reference without the mode
    names = _tiny_models(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "SMP_ADAPTER_CUDA_ON_CPU"}
    env.update({"PYTHONPATH": str(ROOT / "adapter"), "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu",
                "SMP_ADAPTER_CUDA_ON_CPU": "1"})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(LOAD), str(tmp_path), *names], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with_mode = torch.load(tmp_path / "loaded.pt")
    for name in names:
        model = AutoModel.from_pretrained(tmp_path / name)
        reference = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
        assert sorted(with_mode[name]) == sorted(reference), name
        differ = [k for k, v in reference.items()
                  if with_mode[name][k].dtype != v.dtype or not torch.equal(with_mode[name][k], v)]
        assert not differ, f"{name}: loaded differently under CUDA on CPU ranks: {differ}"

