"""The launchers' command lines, environments and dry-run texts, against lines recorded from the code before
the launchers became objects (launch/launchers.py): every launcher on one node and on several, with a hostfile,
--cpu and --gpu, custom_mpi_options, dry-run text, translate's lines and the SageMaker toolkit's line.

Paths that differ per machine (the job directory, this Python, the package root, mpirun's place) are written
as <job>, <python>, <root>, <mpirun>; os.cpu_count() is 8. ``python tests/unit/test_launcher_lines.py
--record`` rewrites launcher_lines.json: only when a line is meant to change, and say so in the commit."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import sys
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("launcher_lines.json")
BUNDLED = re.compile(r"(SMP_ADAPTER_ENV_B64=)([A-Za-z0-9+/=]+)")  # launch/env_bundle.py's bundle, shown decoded
OPTIONS = '{"ddp": true, "microbatches": 2}'
DIST = json.dumps({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
    "partitions": 2, "microbatches": 4, "ddp": True}}},
    "mpi": {"enabled": True, "processes_per_host": 2,
            "custom_mpi_options": "-verbose --NCCL_DEBUG WARN -x FOO=bar -mca pml ob1 -mca btl_tcp_if_exclude lo"}})

# name -> launch arguments (before the script); the script and "--lr 0.1" follow
LAUNCH_CASES = {
    f"{launcher}-{nodes}-{device}": [*(["--launcher", launcher]), *extra, f"--{device}"]
    for launcher in ("deepspeed", "torchrun", "mpirun", "srun")
    for nodes, extra in {
        "one": ["--options", OPTIONS, "--nproc-per-node", "2", "--master-port", "29511"],
        "two": ["--options", OPTIONS, "--nproc-per-node", "2", "--nnodes", "2", "--master-port", "29511",
                *(["--hostfile", "<hostfile>"] if launcher in ("deepspeed", "mpirun") else []),
                *(["--node-rank", "1", "--master-addr", "10.0.0.1"] if launcher == "torchrun" else [])],
        "dist": ["--distribution", "<dist>", "--master-port", "29511", "--hp", "epochs=2", "--channel", "train=<job>"],
    }.items()
    for device in ("cpu", "gpu")
}
LAUNCH_CASES.update({
    "deepspeed-hostfile-slots": ["--options", OPTIONS, "--hostfile", "<hostfile>", "--master-port", "29511", "--cpu"],
    "torchrun-two-heartbeat": ["--launcher", "torchrun", "--options", OPTIONS, "--nproc-per-node", "2", "--nnodes",
                               "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--node-heartbeat-port", "31000",
                               "--node-timeout", "30", "--cpu"],
    "mpirun-no-mp-parameters": ["--launcher", "mpirun", "--options", OPTIONS, "--nproc-per-node", "2",
                                "--master-port", "29511", "--no-mp-parameters", "--comm-ledger", "<job>/ledger",
                                "--cpu"],
    "deepspeed-free-port": ["--options", '{"ddp": true, "ddp_port": 29700}', "--nproc-per-node", "2", "--gpu"],
})
# name -> translate arguments
TRANSLATE_CASES = {
    "options-cpu": [OPTIONS, "--world-size", "2", "--cpu", "--master-port", "29511"],
    "options-two-nodes": [OPTIONS, "--world-size", "4", "--instance-count", "2"],
    "dist": ["<dist>"],
    "dist-two-nodes": ["<dist>", "--instance-count", "2", "--script", "my train.py", "--instance-type", "ml.p4d.24xlarge"],
}


class _Paths:
    def __init__(self, tmp: Path):
        import smp_adapter
        from smp_adapter.launch.inputs import launcher_program

        self.tmp = tmp
        self.pairs = [(str(tmp), "<job>"), (sys.executable, "<python>"),
                      (launcher_program("mpirun", required=False), "<mpirun>"),
                      (str(Path(smp_adapter.__file__).resolve().parents[1]), "<root>")]
        (tmp / "train.py").write_text("import smdistributed.modelparallel.torch as smp\nsmp.init({'ddp': True})\n")
        (tmp / "hostfile").write_text("host-a slots=2\nhost-b slots=2\n")
        (tmp / "dist.json").write_text(DIST)

    def fill(self, args: list[str]) -> list[str]:
        subst = {"<hostfile>": str(self.tmp / "hostfile"), "<dist>": str(self.tmp / "dist.json")}
        return [subst.get(a, a.replace("<job>", str(self.tmp))) for a in args]

    def blank(self, value):
        if isinstance(value, str):
            value = BUNDLED.sub(lambda m: f"{m[1]}<base64 of {self.blank(base64.b64decode(m[2]).decode())}>", value)
            for real, name in self.pairs:
                value = value.replace(real, name) if real and real != name else value
            return value
        if isinstance(value, dict):
            return {self.blank(k): self.blank(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.blank(v) for v in value]
        return value


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from smp_adapter.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _job_fields(args: list[str]) -> dict:
    """What launch's build hands the supervisor, beyond the dry-run text."""
    from smp_adapter.cli import build_parser
    from smp_adapter.commands.launch import _script_options
    from smp_adapter.launch.job import build

    job = build(build_parser().parse_args(["launch", "--dry-run", *args]), _script_options)
    return {"command": list(job.command), "rank_offset": job.rank_offset, "heartbeat": job.heartbeat,
            "dirs": {k: str(v) for k, v in job.dirs.items()}, "channels": job.channels,
            "deepspeed_env": job.deepspeed_env}


def _environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SMP_ADAPTER", "SM_", "OMPI_", "SLURM_")) or name in ("OMP_NUM_THREADS", "DS_ACCELERATOR"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    # The record holds the bare names when PATH has no mpirun/srun: a machine with slurm-wlm or Open MPI
    # installed (CI's distributed tier installs slurm-wlm) must give the same lines, so PATH is not asked.
    import shutil

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which",
                        lambda name, *a, **k: None if name in ("mpirun", "srun") else real_which(name, *a, **k))


def record_all(tmp: Path, monkeypatch) -> dict:
    _environment(monkeypatch)
    monkeypatch.chdir(tmp)
    paths = _Paths(tmp)
    out = {"launch": {}, "translate": {}}
    for name, args in LAUNCH_CASES.items():
        argv = [*paths.fill(args), "--job-dir", str(tmp), "train.py", "--lr", "0.1"]
        code, text, err = _cli(["launch", "--dry-run", *argv])
        entry = {"code": code, "dry_run": paths.blank(text), "error": paths.blank(err)}
        if code == 0:
            entry["job"] = paths.blank(_job_fields(argv))
        out["launch"][name] = entry
    for name, args in TRANSLATE_CASES.items():
        for fmt in ("text", "json"):
            code, text, err = _cli(["translate", *paths.fill(args), "--format", fmt])
            out["translate"][f"{name}-{fmt}"] = {"code": code, "out": paths.blank(text), "error": paths.blank(err)}
    return out


@pytest.fixture(scope="module")
def recorded():
    return json.loads(RECORD.read_text())


@pytest.fixture(scope="module")
def now(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        yield record_all(tmp_path_factory.mktemp("job"), mp)


@pytest.mark.parametrize("name", list(LAUNCH_CASES))
def test_launch_dry_run_and_job_as_recorded(name, recorded, now):
    assert now["launch"][name] == recorded["launch"][name]


@pytest.mark.parametrize("name", [f"{n}-{f}" for n in TRANSLATE_CASES for f in ("text", "json")])
def test_translate_lines_as_recorded(name, recorded, now):
    assert now["translate"][name] == recorded["translate"][name]


def test_the_record_covers_every_launcher_and_its_own_lines(recorded):
    lines = "\n".join(case["dry_run"] for case in recorded["launch"].values())
    for head in ("-m deepspeed.launcher.runner", "-m torch.distributed.run", "<mpirun> --host", "<mpirun> --hostfile",
                 "srun --nodes 2", "DS_ENV_FILE", "--tee 3", "--export=ALL"):
        assert head in lines, head
    assert any("-m mpi4py" in case["out"] for case in recorded["translate"].values())  # the toolkit's line


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        RECORD.write_text(json.dumps(record_all(Path(tmp).resolve(), mp), indent=1, sort_keys=True) + "\n")
