"""A model's shape for the plan: parameter counts and the sizes activations scale with, read from a
Hugging Face config (file, directory or dict) as pure arithmetic over its fields, no torch needed.

Families with their parameter formulas written out: gpt2, gpt_neox, llama-style decoders (llama,
mistral, qwen2, ...: gated MLP, optional grouped KV heads), vit, bert/roberta. Any other family
transformers knows is built on the meta device (no weights) to count parameters, as the class its
``architectures`` names (so a causal LM keeps its head); a family transformers does not know is
refused at once, from the list of model types in transformers' source, without importing it.
Per-layer parameters are what a transformer layer holds; the rest (embeddings, final norm, head) is
``outer_params``. ``tp_split_params`` is the part tensor parallelism divides (the layers' matrices).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from smp_adapter.plan.input_errors import PlanInputError

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "mixtral_dense", "olmo", "phi3")


@dataclass(frozen=True)
class ModelSpec:
    """Tensors are (numel, split) pairs: split = divided by tensor parallelism (layer matrices,
    vocabulary-parallel embeddings); per-tensor sizes decide ZeRO-3's persistence threshold."""

    family: str
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int  # 0: no token head (classification of images)
    seq_len: int
    layer_tensors: tuple  # one transformer layer's parameters
    outer_tensors: tuple  # embeddings, final norm, heads
    num_labels: int = 0
    kv_hidden: int = 0  # k/v projection width (grouped-query attention); 0: = hidden
    tied_embeddings: bool = False  # the token head shares the input embedding's weight
    mlp_saved: int = 2  # tensors of b x s x intermediate the MLP keeps for backward (its activation's)
    # learned position tables looked up with 1 x s ids, broadcast over the batch (GPT-2's wpe), which
    # smp's tensor parallelism splits like the vocabulary: their exchanges move one sample's worth
    position_tables: int = 0
    # the model's modules as trees (plan/zero3.py: DeepSpeed's coordinator fetches at every module call,
    # and gathers and releases a module's own parameters together): node = (tensors, children), tensors
    # a count of the next tensors of outer_tensors (model_modules) or layer_tensors (layer_modules), or
    # "layers" (where the layers run) or "tied" (the head reading the vocabulary table again); () takes
    # zero3.default_trees: one module per tensor
    model_modules: tuple = ()
    layer_modules: tuple = ()

    @property
    def layer_params(self) -> int:
        return sum(n for n, _ in self.layer_tensors)

    @property
    def outer_params(self) -> int:
        return sum(n for n, _ in self.outer_tensors)

    @property
    def total_params(self) -> int:
        return self.layers * self.layer_params + self.outer_params


def _field(cfg: dict, *names, default=None):
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


RECIPE_SUFFIXES = (".yaml", ".yml")


def recipe_model(path: Path):
    """A recipe (recipes/*.yaml) as --model: its ``model_config`` (a Hugging Face config mapping, or a
    config.json path relative to the recipe), else its ``hyperparameters.model_name_or_path`` when that
    is a local directory or file. A recipe whose script builds the model from its own arguments names
    no config plan can read without running the script: that is an error naming the fix."""
    from smp_adapter.config.distribution import load_mapping

    recipe = load_mapping(path)
    named = recipe.get("model_config")
    if named is None:
        hyper = recipe.get("hyperparameters") if isinstance(recipe.get("hyperparameters"), dict) else {}
        named = hyper.get("model_name_or_path")
        if isinstance(named, str) and not (path.parent / named).exists():
            named = None  # a Hub model name: plan reads no network
    if isinstance(named, dict):
        return named
    if isinstance(named, str):
        return read_config(path.parent / named)
    raise PlanInputError("recipe", "--model", "is a recipe that names no model config plan can read (its script "
                         "builds the model from its own arguments)",
                         "add model_config: <a Hugging Face config mapping, or the path of its config.json> to "
                         "the recipe, set hyperparameters.model_name_or_path to a local model directory, or give "
                         "--model config.json", str(path))


def read_config(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    path = Path(path_or_dict)
    if path.suffix.lower() in RECIPE_SUFFIXES:
        return dict(recipe_model(path))
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise PlanInputError("model config file", "--model", f"cannot be read ({exc.strerror})",
                             "give a Hugging Face config.json (or the directory holding it)", str(path_or_dict)) from None
    except ValueError:
        raise PlanInputError("model config file", "--model", "is not JSON",
                             "give a Hugging Face config.json (or its directory)", str(path_or_dict)) from None
    if not isinstance(data, dict):
        raise PlanInputError("model config file", "--model", "is not a JSON object", "give a Hugging Face config.json",
                             str(path_or_dict))
    return data


def model_spec(config, seq_len: int | None = None) -> ModelSpec:
    cfg = read_config(config)
    kind = str(cfg.get("model_type", "")).lower()
    if not kind:  # a config without model_type: guess from its fields (GPT-2 style n_embd, or ViT image fields)
        kind = "gpt2" if "n_embd" in cfg else "vit" if "image_size" in cfg else ""
    h = _field(cfg, "hidden_size", "n_embd", "d_model")
    layers = _field(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _field(cfg, "num_attention_heads", "n_head")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise PlanInputError("sequence length", "--seq-len", "must be a positive integer (tokens per sample)",
                             "give the training sequence length, e.g. --seq-len 4096, or leave it out to use the "
                             "config's maximum", seq_len)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (h, layers, heads)):
        raise PlanInputError("model config", "--model", "is not a transformer model config: hidden_size/n_embd, "
                             "num_hidden_layers/n_layer and num_attention_heads/n_head must be positive integers",
                             "give a Hugging Face model config.json (e.g. saved by AutoConfig.save_pretrained)",
                             kind or "<no model_type>")
    if kind == "gpt2":
        return _gpt2(cfg, h, layers, heads, seq_len)
    if kind == "gpt_neox":
        return _gpt_neox(cfg, h, layers, heads, seq_len)
    if kind in LLAMA_LIKE:
        return _llama(cfg, kind, h, layers, heads, seq_len)
    if kind == "vit":
        return _vit(cfg, h, layers, heads, seq_len)
    if kind in ("bert", "roberta"):
        return _bert(cfg, kind, h, layers, heads, seq_len)
    return _meta_built(cfg, kind, h, layers, heads, seq_len)


def _seq(seq_len, cfg, *names):
    if seq_len is not None:
        return seq_len
    value = _field(cfg, *names)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanInputError("sequence length", "--seq-len", "is needed: the config gives no maximum sequence length",
                             "give --seq-len N")
    return value


# Hugging Face's GPT2LMHeadModel as its forward calls its modules: transformer (wte, wpe, drop, the
# blocks, ln_f), then lm_head (tied to wte); a GPT2Block: ln_1, attn (c_attn, c_proj, resid_dropout),
# ln_2, mlp (c_fc, act, c_proj, dropout); each LayerNorm and Conv1D a weight and a bias
_LEAF = ((0, ()), (1, ()), (2, ()))
GPT2_MODEL = (0, ((0, (_LEAF[1], _LEAF[1], _LEAF[0], ("layers", ()), _LEAF[2])), ("tied", ())))
GPT2_BLOCK = (0, (_LEAF[2], (0, (_LEAF[2], _LEAF[2], _LEAF[0])), _LEAF[2], (0, (_LEAF[2], _LEAF[0], _LEAF[2], _LEAF[0]))))


def _gpt2(cfg, h, layers, heads, seq_len):
    inner = _field(cfg, "n_inner", default=None) or 4 * h
    vocab, positions = cfg.get("vocab_size", 50257), cfg.get("n_positions", 1024)
    # ln_1, c_attn (h x 3h + 3h), attn c_proj (h x h + h), ln_2, mlp c_fc (h x inner + inner), c_proj (inner x h + h)
    layer = ((h, False), (h, False), (h * 3 * h, True), (3 * h, True), (h * h, True), (h, False), (h, False), (h, False),
             (h * inner, True), (inner, True), (inner * h, True), (h, False))
    outer = ((vocab * h, True), (positions * h, False), (h, False), (h, False))  # wte (tied lm_head), wpe, ln_f
    # gelu_new (GPT-2's default) is a tanh formula of Python operators: its input, tanh's output, the
    # two factors of the last product and that product (the projection's input) are kept
    mlp_saved = 5 if cfg.get("activation_function", "gelu_new") == "gelu_new" else 2
    return ModelSpec("gpt2", layers, h, heads, inner, vocab, _seq(seq_len, cfg, "n_positions"), layer, outer,
                     tied_embeddings=cfg.get("tie_word_embeddings", True), mlp_saved=mlp_saved,
                     position_tables=1,  # wpe
                     model_modules=GPT2_MODEL, layer_modules=GPT2_BLOCK)


def _gpt_neox(cfg, h, layers, heads, seq_len):
    """GPT-NeoX (EleutherAI's GPT-NeoX-20B, Pythia): rotary positions (no table), a fused q|k|v with
    biases, a GELU MLP with biases, two LayerNorms per layer, and an untied output head (embed_out)."""
    inter = cfg.get("intermediate_size") or 4 * h
    vocab = cfg.get("vocab_size", 50432)
    # input_layernorm, post_attention_layernorm, query_key_value (+bias), dense (+bias), h->4h (+bias), 4h->h (+bias)
    layer = ((h, False), (h, False), (h, False), (h, False), (h * 3 * h, True), (3 * h, True), (h * h, True), (h, False),
             (h * inter, True), (inter, True), (inter * h, True), (h, False))
    tied = bool(cfg.get("tie_word_embeddings", False))
    outer = ((vocab * h, True), (h, False), (h, False)) + (() if tied else ((vocab * h, True),))  # embed_in, final LN, embed_out
    # GELU keeps its input and output; the tanh approximations (gelu_fast, gelu_new: GPT-NeoX-20B's
    # config names gelu_fast) are formulas of Python operators keeping five tensors, as GPT-2's
    mlp_saved = 5 if cfg.get("hidden_act", "gelu") in ("gelu_fast", "gelu_new") else 2
    return ModelSpec("gpt_neox", layers, h, heads, inter, vocab, _seq(seq_len, cfg, "max_position_embeddings"), layer,
                     outer, tied_embeddings=tied, mlp_saved=mlp_saved)


def _llama(cfg, kind, h, layers, heads, seq_len):
    inter = cfg.get("intermediate_size", 4 * h)
    vocab = cfg.get("vocab_size", 32000)
    head_dim = cfg.get("head_dim") or h // heads
    kv = (cfg.get("num_key_value_heads") or heads) * head_dim
    q = heads * head_dim
    bias = cfg.get("attention_bias") or kind == "qwen2"
    layer = ((h * q, True), (h * kv, True), (h * kv, True), (q * h, True), (h * inter, True), (h * inter, True),
             (inter * h, True), (h, False), (h, False))
    if bias:
        layer += ((q, True), (kv, True), (kv, True))
    outer = ((vocab * h, True), (h, False)) + (() if cfg.get("tie_word_embeddings", False) else ((vocab * h, True),))
    return ModelSpec(kind, layers, h, heads, inter, vocab, _seq(seq_len, cfg, "max_position_embeddings"), layer,
                     outer, kv_hidden=kv, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     mlp_saved=4)  # gate (SiLU's input), SiLU's output, up projection, their product


def _encoder_layer(h, inter):
    """q, k, v, attention output, intermediate, output (weights and biases) and two LayerNorms."""
    return ((h * h, True), (h, True)) * 3 + ((h * h, True), (h, False), (h, False), (h, False),
                                              (h * inter, True), (inter, True), (inter * h, True), (h, False),
                                              (h, False), (h, False))


def _vit(cfg, h, layers, heads, seq_len):
    inter = cfg.get("intermediate_size", 4 * h)
    image, patch, channels = cfg.get("image_size", 224), cfg.get("patch_size", 16), cfg.get("num_channels", 3)
    labels = cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2
    patches = (image // patch) ** 2
    # [CLS], positions (patches + 1), patch projection (+bias), final LayerNorm, classifier
    outer = ((h, False), ((patches + 1) * h, False), (channels * patch * patch * h, False), (h, False), (h, False),
             (h, False), (h * labels, False), (labels, False))
    return ModelSpec("vit", layers, h, heads, inter, 0, seq_len or patches + 1, _encoder_layer(h, inter), outer,
                     num_labels=labels)


def _bert(cfg, kind, h, layers, heads, seq_len):
    inter = cfg.get("intermediate_size", 4 * h)
    vocab, positions, types = cfg.get("vocab_size", 30522), cfg.get("max_position_embeddings", 512), cfg.get("type_vocab_size", 2)
    outer = ((vocab * h, True), (positions * h, False), (types * h, False), (h, False), (h, False), (h * h, False),
             (h, False))  # embeddings, their LayerNorm, pooler
    return ModelSpec(kind, layers, h, heads, inter, vocab, _seq(seq_len, cfg, "max_position_embeddings"),
                     _encoder_layer(h, inter), outer)


def transformers_model_types() -> set[str] | None:
    """The model types transformers knows, read from its source (CONFIG_MAPPING_NAMES in
    models/auto/configuration_auto.py, or auto_mappings.py where newer releases generate it) without
    importing it: importing its registry takes seconds, and a typo in model_type must be refused at
    once. None when transformers is not installed or its layout is not recognised."""
    import importlib.util

    try:
        found = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin:
        return None
    auto = Path(found.origin).parent / "models" / "auto"
    names: set[str] = set()
    for file in ("configuration_auto.py", "auto_mappings.py"):
        try:
            text = (auto / file).read_text()
        except OSError:
            continue
        # ("gpt_neox", "GPTNeoXConfig") tuples and "gpt_neox": "GPTNeoXConfig" entries
        names.update(re.findall(r'"([\w\-]+)"\s*[,:]\s*"\w+Config"', text))
    return names or None


def _known_family(kind: str) -> None:
    """Refuse a model_type no family here and no transformers release installed here knows."""
    known = transformers_model_types()
    if known is None or kind in known:
        return
    own = ["gpt2", "gpt_neox", "vit", "bert", "roberta", *LLAMA_LIKE]
    close = difflib.get_close_matches(kind, sorted(known | set(own)), n=3, cutoff=0.6)
    raise PlanInputError("model family", "model_type", "is not a model family transformers knows (plan counts "
                         f"{', '.join(own[:5])} and llama-style decoders itself, and any family transformers can build)",
                         (f"did you mean {', '.join(repr(c) for c in close)}? " if close else "")
                         + "Set model_type in the config to the family's name as transformers spells it", kind)


def _meta_built(cfg, kind, h, layers, heads, seq_len):
    """Any other family: count its parameters on the meta device (no memory, no weights), built as
    the class the config's ``architectures`` names (GPTNeoXForCausalLM keeps its output head, which
    the bare AutoModel drops), else as a causal LM when the family has one, else the bare model."""
    _known_family(kind)
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

        hf_cfg = AutoConfig.for_model(kind, **{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
        named = [getattr(transformers, a, None) for a in cfg.get("architectures") or [] if isinstance(a, str)]
        with torch.device("meta"):
            if named and named[0] is not None:
                model = named[0](hf_cfg)
            else:
                try:
                    model = AutoModelForCausalLM.from_config(hf_cfg)
                except ValueError:  # the family has no causal-LM head (an encoder, a vision model)
                    model = AutoModel.from_config(hf_cfg)
    except Exception as exc:  # noqa: BLE001 - any failure means "not a model transformers can build"
        raise PlanInputError("model family", "model_type", f"transformers cannot build this model from the config "
                             f"({type(exc).__name__}: {str(exc)[:300]})",
                             "give a complete Hugging Face model config.json (AutoConfig.save_pretrained writes one)",
                             kind) from None
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    in_layers = {id(p) for b in blocks[:1] for layer in b for p in layer.parameters()}
    layer = tuple((p.numel(), p.dim() == 2) for p in blocks[0][0].parameters()) if blocks else ()
    outer = tuple((p.numel(), False) for p in model.parameters() if id(p) not in in_layers)
    inter = _field(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    return ModelSpec(kind, layers, h, heads, inter, cfg.get("vocab_size", 0),
                     _seq(seq_len, cfg, "max_position_embeddings", "n_positions"), layer, outer)
