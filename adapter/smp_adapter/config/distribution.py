"""SageMaker ``distribution`` dicts and option files.

A job description is one of:
  * plain smp options                      {"ddp": true, "tensor_parallel_degree": 2}
  * a SageMaker distribution dict          {"smdistributed": {"modelparallel": {"enabled": true,
                                              "parameters": {...}}}, "mpi": {...}}
    optionally with "instance_count" (the estimator argument) beside it.
Files are JSON or YAML holding either form. The SageMaker Python SDK's rules for the distribution dict are applied here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from smp_adapter.config.limits import MAX_DOCUMENT_DEPTH, MAX_DOCUMENT_NODES, MAX_FILE_BYTES
from smp_adapter.config.options import SMPConfig
from smp_adapter.config.problems import ConfigProblem, raise_if_any
from smp_adapter.errors import SMPConfigError


def _yaml_loader():
    """yaml.SafeLoader that also reads YAML 1.2 floats such as 5e8 (YAML 1.1 reads them as strings,
    and smp's docs write int defaults that way)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)$"),
        list("-+0123456789."))
    return Loader


@dataclass(frozen=True)
class JobSpec:
    """What a SageMaker job said about distribution, in engine-neutral terms."""

    options: Mapping[str, Any]
    processes_per_host: int | None = None
    instance_count: int = 1
    custom_mpi_options: str = ""
    source: str = "options"  # "options" or "distribution"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def config(self) -> SMPConfig:
        return SMPConfig.from_dict(self.options)


def _load_yaml(text: str, where: str):
    """YAML with its size bounded: the document is composed (aliases stay references), measured
    as it would be once expanded, and only then constructed. A "billion laughs" file of a few
    lines would otherwise expand to gigabytes."""
    if _flow_depth(text) > MAX_DOCUMENT_DEPTH:  # before the parser: its pure-Python scanner takes seconds here
        _refuse_depth(where)
    loader = _yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        nodes = _expanded_nodes(node, {}, 0, where)
        if nodes > MAX_DOCUMENT_NODES:
            raise_if_any([ConfigProblem(where, f"expands to {nodes} values once its YAML aliases are resolved, more than "
                                        f"smp-adapter's limit of {MAX_DOCUMENT_NODES} (MAX_DOCUMENT_NODES)",
                                        "write the options out without nested aliases")])
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_depth(where: str):
    raise_if_any([ConfigProblem(where, f"nests deeper than {MAX_DOCUMENT_DEPTH} levels (MAX_DOCUMENT_DEPTH)",
                                    "write the options as a flat mapping")])


def _flow_depth(text: str) -> int:
    """Deepest nesting of flow collections ([...], {...}) outside quotes and comments. An approximate
    count (a quote inside a plain scalar hides the brackets after it, so it can only undercount, and
    the composer's own depth check below still applies); it catches 100,000 open brackets in
    milliseconds where PyYAML's scanner needs over a second."""
    depth = deepest = 0
    quote = None
    comment = False
    for ch in text:
        if comment:
            comment = ch != "\n"
        elif quote is not None:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            comment = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _expanded_nodes(node, memo: dict, depth: int, where: str) -> int:
    """Values in ``node`` once aliases are expanded; shared nodes are counted once per use."""
    if depth > MAX_DOCUMENT_DEPTH:
        _refuse_depth(where)
    if id(node) in memo:
        return memo[id(node)]
    value = node.value
    if isinstance(value, list):  # sequence: nodes; mapping: (key, value) pairs
        children = [c for item in value for c in (item if isinstance(item, tuple) else (item,))]
        count = 1 + sum(min(_expanded_nodes(c, memo, depth + 1, where), MAX_DOCUMENT_NODES + 1) for c in children)
    else:
        count = 1
    memo[id(node)] = min(count, MAX_DOCUMENT_NODES + 1)
    return memo[id(node)]


def _load_json(text: str, where: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise_if_any([ConfigProblem(where, f"nests deeper than {MAX_DOCUMENT_DEPTH} levels (MAX_DOCUMENT_DEPTH)",
                                    "write the options as a flat JSON object")])


def _check_depth(data, where: str) -> None:
    """Nesting bounded for documents that parsed (JSON within Python's recursion limit)."""
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DOCUMENT_DEPTH:
            raise_if_any([ConfigProblem(where, f"nests deeper than {MAX_DOCUMENT_DEPTH} levels (MAX_DOCUMENT_DEPTH)",
                                        "write the options as a flat mapping")])
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML file holding one mapping; problems become SMPConfigError."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            raise_if_any([ConfigProblem(str(path), f"is {size} bytes, more than smp-adapter reads for options "
                                        f"({MAX_FILE_BYTES}, MAX_FILE_BYTES)", "give the options file, not another file")])
        text = p.read_text()
    except OSError as exc:
        raise_if_any([ConfigProblem(str(path), f"cannot be read ({exc.strerror})", "give the path of an existing JSON or YAML file")])
    except UnicodeDecodeError:
        raise_if_any([ConfigProblem(str(path), "is not a text file", "give a JSON or YAML file")])
    try:
        if p.suffix.lower() == ".json":
            data = _load_json(text, str(path))
        else:
            data = _load_yaml(text, str(path))
    except SMPConfigError:  # (a ValueError too) already says what is wrong
        raise
    except (RecursionError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise_if_any([ConfigProblem(str(path), f"is not valid {'JSON' if p.suffix.lower() == '.json' else 'YAML/JSON'} "
                                    f"({str(exc)[:200]})", "fix the file's syntax")])
    except Exception as exc:  # yaml.YAMLError and its relatives: user input problems
        raise_if_any([ConfigProblem(str(path), f"is not valid {'JSON' if p.suffix.lower() == '.json' else 'YAML/JSON'} "
                                    f"({str(exc)[:200]})", "fix the file's syntax")])
    _check_depth(data, str(path))
    if not isinstance(data, dict):
        raise_if_any([ConfigProblem(str(path), f"must hold a mapping of options, got {type(data).__name__}",
                                    "write the smp options or a SageMaker distribution dict as a mapping")])
    return data


def _looks_inline(text: str) -> bool:
    """Inline JSON rather than a path: starts like a JSON value (object, array, string, number,
    true/false/null), and no file of that name exists."""
    head = text.lstrip()[:1]
    word = text.strip()
    if not (head in '{["-0123456789' or word in ("true", "false", "null")):
        return False
    try:
        return not Path(text).exists()
    except (OSError, ValueError):  # too long or not a possible file name: not a path
        return True


def inline_json_fix(text: str, exc: json.JSONDecodeError) -> str:
    """The fix for inline JSON that does not parse, from what is wrong with it: brackets left open, keys
    without double quotes (what a shell leaves of an unquoted argument), or the character at fault."""
    opened, closed, in_string, escaped = [], 0, False, False
    for ch in text:  # brackets outside strings: which are still open at the end
        if in_string:
            in_string, escaped = (ch != '"' or escaped), (ch == "\\" and not escaped)
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            opened.append(ch)
        elif ch in "}]" and opened and opened[-1] == "{["["}]".index(ch)]:
            opened.pop()
        elif ch in "}]":  # a closer without its opener: not a matter of what is missing at the end
            closed += 1
    if opened and not closed:
        closers = "".join("}" if ch == "{" else "]" for ch in reversed(opened))
        return f"close what is left open: end the JSON with {closers!r}"
    if '"' not in text and exc.msg.startswith("Expecting property name enclosed in double quotes"):
        return ("the keys have no double quotes (a shell removes them from an unquoted argument): put the whole "
                "JSON in single quotes, e.g. '{\"ddp\": true}'")
    return f"correct the JSON at char {exc.pos} ({text[max(0, exc.pos - 20):exc.pos + 20]!r}), e.g. '{{\"ddp\": true}}'"


def parse_inline_or_file(text: str) -> dict[str, Any]:
    """CLI helper: inline JSON (starts with '{') or a path to a JSON/YAML file."""
    if _looks_inline(text):
        if len(text) > MAX_FILE_BYTES:
            raise_if_any([ConfigProblem("INPUT", f"is {len(text)} characters, more than {MAX_FILE_BYTES} (MAX_FILE_BYTES)",
                                        "give the smp options, e.g. '{\"ddp\": true}'")])
        try:
            data = _load_json(text, "INPUT")
        except json.JSONDecodeError as exc:
            raise_if_any([ConfigProblem("INPUT", f"is not valid inline JSON ({exc.msg} at char {exc.pos})",
                                        inline_json_fix(text, exc), text)])
        if not isinstance(data, dict):
            raise_if_any([ConfigProblem("INPUT", f"options must be a JSON object ({{...}}), got a JSON "
                                        f"{type(data).__name__}", "e.g. '{\"ddp\": true}'", text)])
        _check_depth(data, "INPUT")
        return data
    return load_mapping(text)


def job_from_mapping(data: Mapping[str, Any], base_dir: Path | None = None) -> JobSpec:
    """Recognise plain options vs a distribution dict and check the SageMaker SDK rules."""
    data = dict(data)
    if not ({"smdistributed", "mpi", "torch_distributed"} & data.keys()):
        return JobSpec(options=data)
    problems: list[ConfigProblem] = []
    instance_count = data.pop("instance_count", 1)
    if not isinstance(instance_count, int) or isinstance(instance_count, bool) or instance_count < 1:
        problems.append(ConfigProblem("instance_count", "must be an integer >= 1", "use the estimator's instance_count", instance_count))
        instance_count = 1
    if "torch_distributed" in data:
        problems.append(ConfigProblem(
            "torch_distributed", "selects SageMaker model parallelism v2 (torch.sagemaker), a different library",
            "for smp v1 scripts use {'smdistributed': {'modelparallel': ...}, 'mpi': {'enabled': true}}"))
    # heterogeneous clusters: the SDK names the instance groups that run the distributed job; here
    # the job runs on the hosts it is launched on (recorded, and said by translate --explain)
    instance_groups = data.pop("instance_groups", None)
    if instance_groups is not None and not (isinstance(instance_groups, list)
                                            and all(isinstance(g, str) for g in instance_groups)):
        problems.append(ConfigProblem("instance_groups", "must be a list of instance group names",
                                      "e.g. ['train_group'], or leave it out", instance_groups))
        instance_groups = None
    unknown = sorted(set(data) - {"smdistributed", "mpi", "torch_distributed"})
    for key in unknown:
        problems.append(ConfigProblem(key, "is not a key of a SageMaker distribution dict for smp v1",
                                      "keep only 'smdistributed', 'mpi' (and 'instance_count')"))
    options = _parameters(data.get("smdistributed"), base_dir, problems)
    mpi = data.get("mpi")
    ppn, custom = None, ""
    if not isinstance(mpi, dict):
        problems.append(ConfigProblem("mpi", "is required for smp v1 (it ran as an MPI job) and must be a dict",
                                      "add 'mpi': {'enabled': true, 'processes_per_host': <GPUs per instance>}", mpi))
    else:
        if mpi.get("enabled") is not True:
            problems.append(ConfigProblem("mpi.enabled", "must be true for smp v1", "set mpi.enabled: true", mpi.get("enabled")))
        ppn = mpi.get("processes_per_host")
        if ppn is not None and (not isinstance(ppn, int) or isinstance(ppn, bool) or ppn < 1):
            problems.append(ConfigProblem("mpi.processes_per_host", "must be an integer >= 1",
                                          "use the number of GPUs per instance", ppn))
            ppn = None
        custom = mpi.get("custom_mpi_options", "")
        if not isinstance(custom, str):
            problems.append(ConfigProblem("mpi.custom_mpi_options", "must be a string of mpirun flags",
                                          "e.g. '-x NCCL_DEBUG=WARN'", custom))
            custom = ""
        for key in sorted(set(mpi) - {"enabled", "processes_per_host", "custom_mpi_options"}):
            problems.append(ConfigProblem(f"mpi.{key}", "is not an mpi option",
                                          "use enabled, processes_per_host, custom_mpi_options"))
    raise_if_any(problems)
    return JobSpec(options=options, processes_per_host=ppn, instance_count=instance_count,
                   custom_mpi_options=custom, source="distribution",
                   extra={"instance_groups": instance_groups} if instance_groups else {})


def _parameters(smd: Any, base_dir: Path | None, problems: list[ConfigProblem]) -> dict[str, Any]:
    if smd is None:
        problems.append(ConfigProblem("smdistributed", "is missing",
                                      "add 'smdistributed': {'modelparallel': {'enabled': true, 'parameters': {...}}}"))
        return {}
    if not isinstance(smd, dict) or len(smd) != 1 or "modelparallel" not in smd:
        if isinstance(smd, dict) and "dataparallel" in smd:
            fix = "smdistributed.dataparallel is SageMaker's data-parallel library: use modelparallel with ddp: true"
        else:
            fix = "use exactly one key, 'modelparallel'"
        problems.append(ConfigProblem("smdistributed", "must be a dict with exactly the key 'modelparallel'", fix, smd))
        return {}
    mp = smd["modelparallel"]
    if not isinstance(mp, dict):
        problems.append(ConfigProblem("smdistributed.modelparallel", "must be a dict", "{'enabled': true, 'parameters': {...}}", mp))
        return {}
    if mp.get("enabled") is not True:
        problems.append(ConfigProblem("smdistributed.modelparallel.enabled", "is not true, so SageMaker would ignore the parameters",
                                      "set enabled: true", mp.get("enabled")))
    for key in sorted(set(mp) - {"enabled", "parameters"}):
        problems.append(ConfigProblem(f"smdistributed.modelparallel.{key}", "is not a modelparallel key",
                                      "put smp options under 'parameters'"))
    params = mp.get("parameters", {})
    if isinstance(params, str):  # the SDK also takes a path to a JSON file
        path = Path(params)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        params = load_mapping(path)
    if not isinstance(params, dict):
        problems.append(ConfigProblem("smdistributed.modelparallel.parameters", "must be a dict or a path to a JSON file",
                                      "give the smp options as a mapping", params))
        return {}
    return params


def load_job(path_or_json: str) -> JobSpec:
    """CLI entry: inline JSON or a file, plain options or a distribution dict."""
    data = parse_inline_or_file(path_or_json)
    base = None if _looks_inline(path_or_json) else Path(path_or_json).resolve().parent
    # recipes and config files may hold {"smp_options": {...}} beside other sections
    if "smp_options" in data and not ({"smdistributed", "mpi"} & data.keys()):
        inner = data["smp_options"]
        if not isinstance(inner, dict):
            raise_if_any([ConfigProblem("smp_options", "must be a mapping of smp options", "write smp_options: {ddp: true, ...}", inner)])
        return job_from_mapping(inner, base)
    if "distribution" in data and isinstance(data["distribution"], dict):
        dist = dict(data["distribution"])
        if "instance_count" in data:
            dist.setdefault("instance_count", data["instance_count"])
        return job_from_mapping(dist, base)
    return job_from_mapping(data, base)
