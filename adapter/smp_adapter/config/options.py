"""SMPConfig: the validated smp options, and how raw option dicts become one.

``SMPConfig.from_dict(raw)`` checks every key against the policy table (keys.py), collects every
problem and raises a single ``SMPConfigError`` listing them all. Rules that need the world size
(degrees dividing it, sdp dividing the rdp size) live in ``dims.ParallelDims``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from smp_adapter.config.keys import KEYS, Policy
from smp_adapter.config.layout import VALID_ORDERS, placement_order
from smp_adapter.config.limits import MAX_DEGREE
from smp_adapter.config.pipeline_schedule import schedule_problems, virtual_degree
from smp_adapter.config.problems import ConfigProblem, raise_if_any

ENV_MP_PARAMETERS = "SM_HP_MP_PARAMETERS"


def _default(key: str) -> Any:
    """A field's default: its key's row in keys.py, the one home of the defaults."""
    return KEYS[key].default


@dataclass(frozen=True)
class SMPConfig:
    """Effective smp options (aliases folded in, formula defaults resolved).

    Attribute names are the smp key names, so ``smp.state.cfg.fp16`` reads as in smp v1. Defaults are
    keys.py's; the three formula defaults (None there: resolved by ``from_dict``) hold their value at the
    default options here (tests/unit/test_options.py ties both).
    """

    pipeline_parallel_degree: int = _default("pipeline_parallel_degree")
    tensor_parallel_degree: int = _default("tensor_parallel_degree")
    microbatches: int = _default("microbatches")
    pipeline: str = _default("pipeline")
    virtual_pipeline_degree: int = 1  # formula: smp-adapter extension, stages per pipeline rank (config/pipeline_schedule.py)
    active_microbatches: int = 1  # formula: partitions + 2, clamped to microbatches
    placement_strategy: str = _default("placement_strategy")
    auto_partition: bool = _default("auto_partition")
    default_partition: int = _default("default_partition")
    optimize: str = _default("optimize")
    memory_weight: float = 0.8  # formula: 0.2 with optimize: speed
    ddp: bool = _default("ddp")
    ddp_port: int | None = _default("ddp_port")
    ddp_dist_backend: str = _default("ddp_dist_backend")
    shard_optimizer_state: bool = _default("shard_optimizer_state")
    offload_activations: bool = _default("offload_activations")
    activation_loading_horizon: int = _default("activation_loading_horizon")
    delayed_parameter_initialization: bool = _default("delayed_parameter_initialization")
    prescaled_batch: bool = _default("prescaled_batch")
    fp16: bool = _default("fp16")
    bf16: bool = _default("bf16")
    sharded_data_parallel_degree: int = _default("sharded_data_parallel_degree")
    sdp_reduce_bucket_size: int = _default("sdp_reduce_bucket_size")
    sdp_param_persistence_threshold: int = _default("sdp_param_persistence_threshold")
    sdp_max_live_parameters: int = _default("sdp_max_live_parameters")
    sdp_hierarchical_allgather: bool = _default("sdp_hierarchical_allgather")
    sdp_gradient_clipping: float = _default("sdp_gradient_clipping")
    # Bookkeeping, not smp keys: which keys the user gave, and the ignored-key warnings.
    given: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    warnings: tuple[str, ...] = field(default=(), compare=False, repr=False)

    # -- smp v1 spellings ----------------------------------------------------------------------
    def __getattr__(self, name: str):
        """Every other smp key (keys.py: accepted-and-ignored ones such as ``skip_tracing``,
        ``contiguous``, ``fast_mode``; rejected ones such as ``horovod``, which can only hold their
        default) answers the value given, else its default, as smp v1's ``smp.state.cfg.<key>`` did.
        Aliases answer their target's value. Only called for names that are not fields."""
        row = KEYS.get(name) if not name.startswith("__") else None
        if row is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (not an smp option)")
        if row.policy is Policy.ALIAS:
            return getattr(self, row.alias_of)
        return self.__dict__.get("given", {}).get(name, row.default)

    @property
    def partitions(self) -> int:
        return self.pipeline_parallel_degree

    @property
    def fp16_params(self) -> bool:
        return self.fp16

    @property
    def placement_order(self) -> str:
        return placement_order(self.placement_strategy)

    @property
    def sharded_data_parallel(self) -> bool:
        return self.sharded_data_parallel_degree > 1

    def to_dict(self) -> dict[str, Any]:
        """The effective options as a plain dict (smp key names)."""
        skip = {"given", "warnings"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "SMPConfig":
        raw = dict(raw or {})
        problems: list[ConfigProblem] = []
        values: dict[str, Any] = {}
        warnings: list[str] = []
        for key, value in raw.items():
            coerced = _check_key(key, value, problems)
            if coerced is not _INVALID:
                values[key] = coerced
        _fold_aliases(values, problems)
        for key in values:
            row = KEYS[key]
            if row.policy is Policy.IGNORED:
                warnings.append(f"smp option '{key}' is accepted and ignored: {row.note}")
        _check_cross_key_rules(values, raw, problems)
        if problems:  # the valid values still make a config: the layout rules are checked on it too
            raise_if_any(problems, cls._from_values(values, raw, warnings))
        return cls._from_values(values, raw, warnings)

    @classmethod
    def _from_values(cls, values: dict[str, Any], raw: dict[str, Any], warnings: list[str]) -> "SMPConfig":
        """The config of per-key-valid ``values``, formula defaults resolved (from_dict's last step)."""
        kwargs = {k: v for k, v in values.items() if k in _FIELD_NAMES}
        pp = kwargs.get("pipeline_parallel_degree", 1)
        mb = kwargs.get("microbatches", 1)
        # smp v1's default active_microbatches, partitions + 2, exceeds microbatches = 1; clamp it (more than
        # `microbatches` can never be in flight anyway), and clamp a user value the same way.
        kwargs["active_microbatches"] = min(kwargs.get("active_microbatches", pp + 2), mb)
        kwargs["virtual_pipeline_degree"] = virtual_degree(kwargs)
        if "memory_weight" not in kwargs:
            kwargs["memory_weight"] = 0.2 if kwargs.get("optimize") == "speed" else 0.8
        if kwargs.get("offload_activations") and mb == 1:
            warnings.append("smp option 'offload_activations' only takes effect with activation checkpointing "
                            "and microbatches > 1 (as in smp v1)")
        return cls(**kwargs, given=dict(raw), warnings=tuple(warnings))

    @classmethod
    def from_sources(cls, script_options: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> "SMPConfig":
        """Options as ``smp.init(config)`` sees them: the script's dict, overridden key by key
        by the launch-time ``SM_HP_MP_PARAMETERS`` (as on SageMaker)."""
        merged = dict(script_options or {})
        merged.update(options_from_environ(os.environ if environ is None else environ))
        return cls.from_dict(merged)


_INVALID = object()
_FIELD_NAMES = {f.name for f in fields(SMPConfig)} - {"given", "warnings"}


def options_from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    text = environ.get(ENV_MP_PARAMETERS)
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise_if_any([ConfigProblem(ENV_MP_PARAMETERS, f"is not valid JSON ({exc.msg} at char {exc.pos})",
                                    "set it to a JSON object, e.g. '{\"ddp\": true}'", text)])
    if not isinstance(parsed, dict):
        raise_if_any([ConfigProblem(ENV_MP_PARAMETERS, "must hold a JSON object of smp options",
                                    "set it to a JSON object, e.g. '{\"ddp\": true}'", text)])
    return parsed


def _check_key(key: Any, value: Any, problems: list[ConfigProblem]) -> Any:
    if not isinstance(key, str) or key not in KEYS:
        name = str(key) if len(str(key)) <= 80 else str(key)[:77] + "..."  # a hostile key stays short too
        close = difflib.get_close_matches(name, list(KEYS), n=1, cutoff=0.6)
        fix = f"did you mean '{close[0]}'?" if close else "remove it (see docs/translation.md for the supported keys)"
        problems.append(ConfigProblem(name, "unknown smp option", fix, value))
        return _INVALID
    row = KEYS[key]
    coerced = _coerce(row.kind, value)
    if coerced is _INVALID:
        example = {"int": "4", "bool": "true", "float": "0.5", "str": '"cluster"'}[row.kind]
        problems.append(ConfigProblem(key, f"expected {_KIND_NAMES[row.kind]}, got {type(value).__name__}",
                                      f"write a value like {example} (no quotes for numbers and booleans)", value))
        return _INVALID
    if row.policy is Policy.REJECTED:
        if coerced != row.default:
            problems.append(ConfigProblem(key, "is not supported by smp v1 / smp-adapter", row.note, value))
        return _INVALID
    if row.choices and coerced not in row.choices:
        problems.append(ConfigProblem(key, f"must be one of {', '.join(row.choices)}",
                                      f"use {row.default!r} (the default) or another allowed value", value))
        return _INVALID
    if key == "placement_strategy":
        try:
            placement_order(coerced)
        except ValueError:
            problems.append(ConfigProblem(key, "must be 'cluster', 'spread' or a permutation of the letters D, P, T "
                                          f"({', '.join(VALID_ORDERS)})", "use 'cluster' (= DPT, the default)", value))
            return _INVALID
    if row.minimum is not None and coerced < row.minimum:
        problems.append(ConfigProblem(key, f"must be >= {row.minimum:g}", f"use a value >= {row.minimum:g}", value))
        return _INVALID
    if row.maximum is not None and coerced > row.maximum:
        limit = " (smp-adapter's limit on any degree or count, MAX_DEGREE)" if row.maximum == MAX_DEGREE else ""
        problems.append(ConfigProblem(key, f"must be <= {row.maximum:g}{limit}", f"use a value <= {row.maximum:g}", value))
        return _INVALID
    return coerced


_KIND_NAMES = {"int": "an integer", "bool": "a boolean (true/false)", "float": "a number", "str": "a string"}


def _coerce(kind: str, value: Any) -> Any:
    if kind == "bool":
        return value if isinstance(value, bool) else _INVALID
    if isinstance(value, bool):  # bool is an int subclass: never accept it as a number
        return _INVALID
    if kind == "int":
        if isinstance(value, int):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)  # [DOC] prints int defaults as 5e8
        return _INVALID
    if kind == "float":
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
        return _INVALID
    return value if isinstance(value, str) else _INVALID


def _fold_aliases(values: dict[str, Any], problems: list[ConfigProblem]) -> None:
    for key in [k for k in values if KEYS[k].policy is Policy.ALIAS]:
        target = KEYS[key].alias_of
        value = values.pop(key)
        if key == "fp16_params" and value is False:
            continue  # fp16_params: false says nothing about fp16
        if target in values and values[target] != value:
            problems.append(ConfigProblem(
                key, f"disagrees with {target} = {values[target]!r} (they are the same setting)",
                f"give only {target}, or the same value for both", value))
            continue
        values[target] = value


def _check_cross_key_rules(values: dict[str, Any], raw: Mapping[str, Any], problems: list[ConfigProblem]) -> None:
    g = values.get
    pp, tp, sdp = g("pipeline_parallel_degree", 1), g("tensor_parallel_degree", 1), g("sharded_data_parallel_degree", 1)
    ddp = g("ddp", False)
    add = problems.append
    if g("fp16") and g("bf16"):
        add(ConfigProblem("bf16", "cannot be combined with fp16", "choose one: set fp16: false or bf16: false", True))
    if tp > 1 and not ddp:
        add(ConfigProblem("tensor_parallel_degree", "> 1 requires ddp: true (tensor parallelism runs across data-parallel ranks)",
                          "add ddp: true", tp))
    if sdp > 1 and not ddp:
        add(ConfigProblem("sharded_data_parallel_degree", "> 1 requires ddp: true", "add ddp: true", sdp))
    if g("shard_optimizer_state") and not ddp:
        add(ConfigProblem("shard_optimizer_state", "requires ddp: true (it shards over data-parallel ranks)", "add ddp: true", True))
    if sdp > 1 and pp > 1:
        add(ConfigProblem("sharded_data_parallel_degree", "cannot be combined with pipeline_parallel_degree > 1 (as in smp v1)",
                          "use pipeline_parallel_degree: 1, or shard_optimizer_state: true instead of sharded data parallel", sdp))
    if sdp > 1 and g("shard_optimizer_state"):
        add(ConfigProblem("shard_optimizer_state", "cannot be combined with sharded_data_parallel_degree > 1 "
                          "(sharded data parallel already shards optimizer state)", "remove shard_optimizer_state", True))
    if sdp > 1 and tp > 1 and not g("prescaled_batch"):
        add(ConfigProblem("prescaled_batch", "must be true when sharded data parallel is combined with tensor parallelism (smp v1.15)",
                          "add prescaled_batch: true and feed every rank of a TP group the same batch", raw.get("prescaled_batch", False)))
    if raw.get("auto_partition") is False and "default_partition" not in raw:
        # the SageMaker SDK required the key; defaulting to 0 would silently put every
        # unmarked module on stage 0
        add(ConfigProblem("default_partition", "is required when auto_partition is false (SageMaker SDK rule): it names "
                          "the stage of modules created outside any smp.partition context",
                          "add default_partition: 0 (or the stage those modules belong to)", None))
    dp_ = g("default_partition", 0)
    if dp_ >= pp:
        add(ConfigProblem("default_partition", f"must be < pipeline_parallel_degree ({pp}): stages are numbered 0..{pp - 1}",
                          f"use a value between 0 and {pp - 1}", dp_))
    problems.extend(schedule_problems(values, raw))
    for key in ("ddp_port", "ddp_dist_backend"):
        if key in raw and "ddp" not in raw:
            add(ConfigProblem(key, "is only allowed together with the ddp key (SageMaker SDK rule)", "add ddp: true", raw[key]))
    if raw.get("horovod") is True and raw.get("ddp") is True:
        add(ConfigProblem("horovod", "cannot be combined with ddp: true", "remove horovod", True))
