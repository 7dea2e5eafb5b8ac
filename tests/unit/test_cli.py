"""``smp-adapter translate``: in-process through main() and as a real process; every user error
exits 2 with a message naming the key and no traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from smp_adapter.cli import COMMANDS, main
from test_translate import CONFIG_FILES, REGEN, ds_config_module, parse_ds  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "adapter")}
MAIN = "from smp_adapter.cli import main; raise SystemExit(main())"


def run_cli(*argv):
    return subprocess.run([sys.executable, "-c", MAIN, *argv], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=120)


# -- valid inputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_translate_explain_each_config(path, tmp_path, capsys, parse_ds):
    out = tmp_path / "out"
    assert main(["translate", str(path), "--explain", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    mics = "MiCS: groups of" in captured.out  # sdp < rdp: the MiCS engine's settings, no DeepSpeed config
    engine_heading, engine_file = (("MiCS engine settings (torch FSDP2", "mics.json") if mics
                                   else ("DeepSpeed config:", "deepspeed_config.json"))
    assert ("DeepSpeed config:" in captured.out) is not mics
    for heading in (engine_heading, "Megatron-core settings:", "Megatron-LM arguments: --tensor-model-parallel-size",
                    "Launch with deepspeed:", "Launch with torchrun:", "Launch with mpirun:", "Launch with srun:", "Mapping (smp -> engines):"):
        assert heading in captured.out
    assert sorted(p.name for p in out.iterdir()) == sorted([engine_file, "explain.txt", "launch.json", "megatron.json"])
    table = (out / "explain.txt").read_text()
    assert table.startswith("smp key") and table.rstrip() in captured.out
    # the layout line `plan` prints too (ParallelDims.describe), above the table
    assert re.search(r"^Layout: pp \d+ x tp \d+ x rdp \d+, sdp \d+, (ZeRO stage [013]|MiCS: groups of \d+ shard)",
                     captured.out, re.M)
    if path.name == "sdp2_bf16_hpz.yaml":  # 8 ranks, sdp 2: MiCS by default (hpZ with SMP_ADAPTER_SDP_ENGINE=hpz)
        assert "Layout: pp 1 x tp 1 x rdp 8, sdp 2, MiCS: groups of 2 shard everything, 4 replicas" in captured.out
    megatron = json.loads((out / "megatron.json").read_text())
    if mics:
        settings = json.loads((out / "mics.json").read_text())
        assert settings["reshard_after_forward"] is True and len(settings["shard_groups"][0]) == settings["mesh"]["shape"][1]
    else:
        ds = json.loads((out / "deepspeed_config.json").read_text())
        parsed = parse_ds(ds, megatron["data_parallel_size"])
        assert parsed.zero_optimization_stage == ds["zero_optimization"]["stage"]
    assert set(json.loads((out / "launch.json").read_text())) == {"deepspeed", "torchrun", "mpirun", "srun"}


@pytest.mark.parametrize("path", CONFIG_FILES[:3], ids=lambda p: p.name)
def test_json_format_is_the_golden_content(path, capsys):
    assert main(["translate", str(path), "--format", "json", "--batch-size", str(REGEN.BATCH)]) == 0
    golden = json.loads((REGEN.GOLDEN / f"{path.stem}.json").read_text())
    golden.pop("input")
    assert json.loads(capsys.readouterr().out) == golden


def test_ignored_keys_warn_on_stderr(capsys):
    assert main(["translate", '{"fast_mode": true, "ddp": true}', "--world-size", "2"]) == 0
    err = capsys.readouterr().err
    assert "smp-adapter: warning: smp option 'fast_mode' is accepted and ignored" in err


@pytest.mark.parametrize("names", [["--nproc-per-node", "2", "--nnodes", "3"],
                                   ["--processes-per-host", "2", "--instance-count", "3"]])
def test_translate_takes_launchs_names_and_sagemakers_aliases(names, capsys):
    """translate and launch name the two counts alike; SageMaker's names stay as aliases."""
    assert main(["translate", '{"ddp": true}', "--format", "json", *names]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["nprocs_per_node"], out["nnodes"], out["world_size"]) == (2, 3, 6)
    assert out["launch"]["torchrun"]["command"][:5] == ["torchrun", "--nproc_per_node", "2", "--nnodes", "3"]


def test_world_size_sources(capsys):
    assert main(["translate", '{"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "ddp": true}', "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 4  # pp x tp x sdp
    tp4 = str(CONFIG_FILES[[p.name for p in CONFIG_FILES].index("tp4.yaml")])
    assert main(["translate", tp4, "--format", "json", "--instance-count", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["world_size"], out["nnodes"]) == (16, 2)
    assert main(["translate", tp4, "--format", "json", "--world-size", "4", "--cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and out["launch"]["deepspeed"]["env"]["DS_ACCELERATOR"] == "cpu"


def test_adding_a_command_is_one_line():
    import importlib

    assert COMMANDS == ("translate", "launch", "check", "report", "checkpoint", "plan")
    for name in COMMANDS:  # each listed name is a module with the two functions cli.py calls
        module = importlib.import_module(f"smp_adapter.commands.{name}")
        assert callable(module.add_parser) and callable(module.run)


# -- invalid inputs: exit 2, message names the key, no traceback --------------------------------------
def _dist(params=None, **mpi):
    return {"smdistributed": {"modelparallel": {"enabled": True, "parameters": params or {"ddp": True}}},
            "mpi": {"enabled": True, **mpi}}


INVALID = [  # (inline JSON or callable(tmp_path) -> INPUT, extra args, text expected on stderr)
    ({"tensor_parallel_degree": "4", "ddp": True}, [], "tensor_parallel_degree = '4': expected an integer, got str"),
    ({"tensor_parallel_degree": True, "ddp": True}, [], "tensor_parallel_degree = True: expected an integer, got bool"),
    ({"ddp": 1}, [], "ddp = 1: expected a boolean"),
    ({"microbatches": 2.5}, [], "microbatches = 2.5: expected an integer"),
    ({"tensor_paralel_degree": 2}, [], "did you mean 'tensor_parallel_degree'"),
    ({"pipline": "simple"}, [], "did you mean 'pipeline'"),
    ({"tensor_parallel_degree": 3, "ddp": True}, ["--world-size", "8"], "tensor_parallel_degree = 3"),
    ({"pipeline_parallel_degree": 3, "ddp": True}, ["--world-size", "8"], "pipeline_parallel_degree = 3"),
    ({"ddp": True, "sharded_data_parallel_degree": 3}, ["--world-size", "8"], "sharded_data_parallel_degree = 3: must divide"),
    ({"tensor_parallel_degree": 2}, [], "tensor_parallel_degree = 2: > 1 requires ddp: true"),
    ({"sharded_data_parallel_degree": 2}, [], "sharded_data_parallel_degree = 2: > 1 requires ddp: true"),
    ({"shard_optimizer_state": True}, [], "shard_optimizer_state = True: requires ddp: true"),
    ({"pipeline_parallel_degree": 2}, ["--world-size", "4"], "ddp = False: must be true when there is more than one model replica"),
    ({"fp16": True, "bf16": True}, [], "bf16 = True: cannot be combined with fp16"),
    ({"partitions": 2, "pipeline_parallel_degree": 4}, [], "partitions = 2: disagrees with pipeline_parallel_degree"),
    ({"placement_strategy": "diagonal"}, [], "placement_strategy = 'diagonal'"),
    ({"placement_strategy": "DPP"}, [], "placement_strategy = 'DPP'"),
    ({"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 2}, [], "default_partition = 2: must be <"),
    ({"default_partition": -1}, [], "default_partition = -1: must be >= 0"),
    ({"memory_weight": 1.2}, [], "memory_weight = 1.2: must be <= 1"),
    ({"memory_weight": "high"}, [], "memory_weight = 'high': expected a number"),
    ({"pipeline": "1f1b"}, [], "pipeline = '1f1b': must be one of"),
    ({"optimize": "fast"}, [], "optimize = 'fast': must be one of memory, speed"),
    ({"hybrid_shard_degree": 8}, [], "hybrid_shard_degree = 8: is not supported"),
    ({"sm_activation_offloading": True}, [], "sm_activation_offloading = True: is not supported"),
    ({"microbatches": 4}, ["--batch-size", "6"], "microbatches = 4: must divide the per-rank batch size (6)"),
    ({"ddp": True, "ddp_port": 99999}, [], "ddp_port = 99999: must be <= 65535"),
    ({"ddp": True, "ddp_dist_backend": "mpi"}, [], "ddp_dist_backend = 'mpi': must be one of"),
    ({"horovod": True}, [], "horovod = True"),
    ({"active_microbatches": 0}, [], "active_microbatches = 0: must be >= 1"),
    ({"sdp_gradient_clipping": -1.0}, [], "sdp_gradient_clipping = -1.0: must be >= 0"),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2}, [],
     "sharded_data_parallel_degree = 2: cannot be combined with pipeline_parallel_degree"),
    ({"ddp": True, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2}, [], "prescaled_batch = False: must be true"),
    ({"smdistributed": {"dataparallel": {"enabled": True}}, "mpi": {"enabled": True}}, [], "smdistributed = "),
    ({"torch_distributed": {"enabled": True}, **_dist()}, [], "torch_distributed: selects SageMaker model parallelism v2"),
    ({"smdistributed": _dist()["smdistributed"]}, [], "mpi = None: is required for smp v1"),
    (_dist(processes_per_host="8"), [], "mpi.processes_per_host = '8': must be an integer >= 1"),
    ({**_dist(), "instance_count": 0}, [], "instance_count = 0: must be an integer >= 1"),
    ({"ddp": True}, ["--world-size", "0"], "world_size = 0: must be a positive integer"),
    ({"ddp": True}, ["--world-size", "6", "--instance-count", "4"], "--world-size = 6: must be a multiple of the instance count"),
    ({"ddp": True}, ["--processes-per-host", "0"], "processes_per_host = 0: must be an integer >= 1"),
    ('{"ddp": tru', [], "is not valid inline JSON"),
    (lambda d: str(d / "missing.yaml"), [], "missing.yaml: cannot be read"),
    (lambda d: _write(d / "bad.yaml", "ddp: [true\n"), [], "bad.yaml: is not valid YAML"),
    (lambda d: _write(d / "list.yaml", "- ddp\n"), [], "list.yaml: must hold a mapping of options, got list"),
    (lambda d: _write(d / "opts.yaml", "smp_options: 5\n"), [], "smp_options = 5: must be a mapping"),
    (lambda d: _write(d / "job.json", json.dumps(_dist("nope.json"))), [], "nope.json: cannot be read"),
    (lambda d: _write(d / "fp.yaml", "sdp_reduce_bucket_size: 5e7.5\n"), [],
     "sdp_reduce_bucket_size = '5e7.5': expected an integer, got str"),
]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("given,extra,expected", INVALID, ids=[f"invalid{i}" for i in range(len(INVALID))])
def test_invalid_configurations_exit_2(given, extra, expected, tmp_path, capsys):
    source = given(tmp_path) if callable(given) else given if isinstance(given, str) else json.dumps(given)
    assert main(["translate", source, *extra]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err
    assert captured.err.startswith("smp-adapter translate: error: invalid smp configuration") or "cannot write" in captured.err
    assert "Traceback" not in captured.out + captured.err and captured.out == ""


def test_enough_distinct_invalid_configurations():
    assert len({json.dumps(g, sort_keys=True) if not callable(g) else id(g) for g, _, _ in INVALID}) >= 32


def test_usage_errors_exit_2(capsys):
    assert main(["translate"]) == 2
    assert "the following arguments are required: INPUT" in capsys.readouterr().err
    assert main(["translate", "{}", "--world-size", "4", "--processes-per-host", "2"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["--version"]) == 0


def test_unwritable_out_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["translate", '{"ddp": true}', "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "cannot write" in err and "Traceback" not in err


# -- as a real process ------------------------------------------------------------------------------
def test_subprocess_translate_explain(tmp_path):
    proc = run_cli("translate", "configs/sdp4_mics_vit.yaml", "--explain", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "MiCS engine: torch FSDP2" in proc.stdout and "approximated" in proc.stdout  # sdp 4 < rdp 32
    assert "zero_hpz_partition_size" not in proc.stdout
    assert (tmp_path / "explain.txt").exists()


def test_subprocess_invalid_exits_2():
    proc = run_cli("translate", '{"tensor_parallel_degree": 2, "ddp": "yes", "partitons": 2}')
    assert proc.returncode == 2 and proc.stdout == ""
    assert "ddp = 'yes': expected a boolean" in proc.stderr and "did you mean 'partitions'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_translate_and_cli_do_not_import_engines():
    code = ("import sys\n"
            "import smp_adapter.cli, smp_adapter.commands.translate\n"
            "import smp_adapter.translate.deepspeed, smp_adapter.translate.megatron\n"
            "import smp_adapter.launch.command, smp_adapter.translate.explain\n"
            "from smp_adapter.cli import main\n"
            "rc = main(['translate', 'configs/tp2_pp2_mb4.yaml', '--explain', '--format', 'json'])\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'megatron', 'transformers'))\n"
            "print('HEAVY', heavy, rc, file=sys.stderr)\n"
            "raise SystemExit(1 if heavy or rc else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_launch_failure_summary_reads_the_cause_of_a_rank():
    from smp_adapter.launch.supervisor import _cause

    syntax = ['  File "/job/train.py", line 3', "    def broken(:", "               ^", "SyntaxError: invalid syntax"]
    assert _cause(syntax) == 'SyntaxError: invalid syntax (File "/job/train.py", line 3)'
    assert _cause(["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                   "torch.distributed.DistBackendError: boom"]) == "torch.distributed.DistBackendError: boom"
    assert _cause(["loss 0.5", "done"]) is None


def test_every_problem_of_options_and_layout_in_one_message(capsys):
    """The options' own problems and the layout's on the world asked for come in one message (usage.md's
    promise), from translate, launch and smp.init alike; a fix already given is not repeated."""
    from smp_adapter.config.distribution import JobSpec
    from smp_adapter.errors import SMPConfigError
    from smp_adapter.launch.command import to_launch_plan
    from smp_adapter.runtime.init import resolve_layout

    raw = {"pipline_parallel_degree": 2, "microbatches": "four", "tensor_parallel_degree": 3}
    assert main(["translate", json.dumps(raw), "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "(4 problems)" in err and "did you mean 'pipeline_parallel_degree'" in err and "'four'" in err
    assert "add ddp: true" in err and "= 3 does not divide the number of processes (4)" in err
    job = JobSpec(options=raw)
    for front_door in (lambda: to_launch_plan(job, None, "train.py", nprocs_per_node=4, cpu=True),
                       lambda: resolve_layout(raw, {"RANK": "0", "WORLD_SIZE": "4"})):
        with pytest.raises(SMPConfigError) as caught:
            front_door()
        assert len(caught.value.problems) == 4 and "does not divide" in str(caught.value)
    # the layout's "ddp must be true" says what the options' "requires ddp: true" already said: once
    assert main(["translate", '{"tensor_parallel_degree": 2}', "--world-size", "4"]) == 2
    assert capsys.readouterr().err.count("add ddp: true") == 1


@pytest.mark.parametrize("text,fix", [
    ('{"tensor_parallel_degree": 3', "end the JSON with '}'"),
    ('{"a": [1, {"b": 2', "end the JSON with '}]}'"),
    ("{ddp: true}", "the keys have no double quotes"),
    ('{"ddp": tru}', "correct the JSON at char 8"),
])
def test_inline_json_that_does_not_parse_gets_the_fix_for_what_is_wrong(text, fix, capsys):
    assert main(["translate", text]) == 2
    err = capsys.readouterr().err
    assert fix in err and ("quote the JSON for your shell" not in err), err


def test_report_points_at_what_a_directory_holds(tmp_path, capsys):
    """report on a launch's job directory names its rank logs and what report reads; --help says what
    RUN_DIR is without citing source files."""
    job = tmp_path / "smp-job"
    (job / "output" / "rank-logs").mkdir(parents=True)
    assert main(["report", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"its ranks' output is in {job / 'output' / 'rank-logs'}" in err and "--comm-ledger DIR" in err
    assert main(["report", "--help"]) == 0
    text = capsys.readouterr().out
    assert "metrics.jsonl" in text and "--comm-ledger" in text and ".py" not in text


def test_report_gives_the_layout_and_one_mean_step_time(tmp_path):
    """The table names the layout the recipe recorded, and its mean step time is metrics.jsonl's steps
    after the first: summary.json carries no second timer."""
    from smp_adapter.commands.report import write_report

    rows = [{"step": i + 1, "loss": 2.0 - i / 10, "step_time_s": t, "tokens_per_s": 100.0}
            for i, t in enumerate([5.0, 0.2, 0.4])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"layout": "pp 1 x tp 1 x rdp 2, sdp 2, ZeRO stage 3"}))
    _, table = write_report(tmp_path)
    assert table.splitlines()[0].split(None, 1) == ["layout", "pp 1 x tp 1 x rdp 2, sdp 2, ZeRO stage 3"]
    assert "mean step time (s)          0.3000 (after the first step)" in table
    source = (Path(__file__).resolve().parents[2] / "recipes/causal_lm/train.py").read_text()
    assert "mean_step_time" not in source and '"layout": smp.state.dims.describe()' in source


def test_checkpoint_help_cites_no_source_files(capsys):
    assert main(["checkpoint", "--help"]) == 0
    out = capsys.readouterr().out
    assert "reshard" in out and "verify" in out and not re.search(r"\w+/\w+\.py", out), out
