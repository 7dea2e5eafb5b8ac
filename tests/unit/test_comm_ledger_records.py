"""The ledger's records without a process group: steps, phases, group names, link classes, and
that nothing is installed when SMP_ADAPTER_COMM_LEDGER is unset (the distributed tier checks the
counts against real runs: tests/distributed/test_comm_ledger.py)."""

import json

import torch
import torch.distributed as dist

from smp_adapter.ledger.summary import ledger_table
from smp_adapter.ledger import record as comm_ledger
from smp_adapter.ledger.record import Ledger, payload_bytes

KINDS = {"tp": (0, 1), "pp": (0, 4), "rdp": (0, 2), "dp": (0, 1, 2, 3), "mp": (0, 1, 4, 5), "world": tuple(range(8))}


def _ledger(tmp_path):
    return Ledger(tmp_path / "rank0.jsonl", rank=0, kind_ranks=KINDS, node_size=4)


def _records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]


def test_steps_and_phases_become_records(tmp_path):
    ledger = _ledger(tmp_path)
    ledger.add("broadcast", (0, 2), 100)  # before any step: phase init
    ledger.step_call(training=True)
    ledger.add("all_reduce", (0, 2), 40)
    ledger.add("all_reduce", (0, 2), 60)
    ledger.step_call(training=True)  # a second step call (gradient accumulation): the same step
    ledger.add("send", (0, 4), 8, p2p=True)
    ledger.optimizer_step_done()
    ledger.step_call(training=False)  # evaluation between steps
    ledger.add("all_gather", (0, 1, 2, 3, 4, 5, 6, 7), 800)
    with_phase = ledger.set_phase("checkpoint")
    ledger.add("barrier", (0, 1, 2, 3, 4, 5, 6, 7), 0)
    ledger.set_phase(with_phase)
    ledger.step_call(training=True)
    ledger.optimizer_step_done()  # a step with no traffic still has its record
    ledger.close()
    records = _records(tmp_path)
    assert [(r["step"], r.get("phase")) for r in records] == [(None, "init"), (0, None), (None, "eval"),
                                                             (None, "checkpoint"), (1, None)]
    step0 = {(o["group"], o["op"]): o for o in records[1]["ops"]}
    assert step0[("rdp", "all_reduce")]["calls"] == 2 and step0[("rdp", "all_reduce")]["bytes"] == 100
    assert step0[("pp", "send")]["intra_node"] is False  # ranks 0 and 4 are on nodes 0 and 1 (4 per node)
    assert step0[("rdp", "all_reduce")]["intra_node"] is True
    assert records[2]["ops"][0]["group"] == "world" and records[2]["ops"][0]["intra_node"] is False
    assert records[4]["ops"] == []


def test_traffic_outside_steps_is_on_disk_without_close(tmp_path):
    """A rank that ends with os._exit never runs close(): the phase records must already be written."""
    ledger = _ledger(tmp_path)
    ledger.add("broadcast", (0, 2), 100)
    ledger.add("broadcast", (0, 2), 50)
    assert _records(tmp_path) == [{"step": None, "phase": "init", "ops": [
        {"group": "rdp", "ranks": [0, 2], "op": "broadcast", "calls": 2, "bytes": 150, "intra_node": True}]}]
    ledger.step_call(training=True)
    ledger.add("all_reduce", (0, 2), 40)
    ledger.optimizer_step_done()
    ledger.add("barrier", (0, 1, 2, 3, 4, 5, 6, 7), 0)  # the script's last call, then os._exit
    records = _records(tmp_path)
    assert [(r["step"], r.get("phase")) for r in records] == [(None, "init"), (0, None), (None, "between_steps")]
    assert records[2]["ops"][0]["op"] == "barrier" and records[2]["ops"][0]["calls"] == 1
    ledger.close()  # closing later rewrites the same record, adds nothing
    assert _records(tmp_path) == records


def test_group_names_follow_smp_kinds(tmp_path):
    ledger = _ledger(tmp_path)
    assert ledger._name((0,)) == "self"
    assert ledger._name((0, 1)) == "tp"
    assert ledger._name((0, 3)) == "other"
    assert ledger._p2p_name((0, 4)) == "pp" and ledger._p2p_name((0, 5)) == "mp"


def test_payload_is_the_tensor_or_the_list():
    t = torch.zeros(3, 5)
    assert payload_bytes(t) == 60
    assert payload_bytes([t, [t.half()]]) == 90
    assert payload_bytes(None) == 0


def test_nothing_is_installed_when_the_variable_is_unset(monkeypatch):
    monkeypatch.delenv(comm_ledger.ENV, raising=False)
    before = dist.all_reduce
    comm_ledger.install_if_requested(None, 0, 1)
    assert comm_ledger._active is None and dist.all_reduce is before


def test_report_summarises_per_group_and_link(tmp_path):
    for rank in (0, 1):
        rows = [{"step": None, "phase": "init", "ops": [{"group": "rdp", "ranks": [0, 1], "op": "broadcast", "calls": 2,
                                                          "bytes": 10, "intra_node": True}]}]
        rows += [{"step": i, "ops": [{"group": "rdp", "ranks": [0, 1], "op": "all_reduce", "calls": 1,
                                      "bytes": 1_000_000 * (9 if i == 0 else 1), "intra_node": False}]} for i in range(3)]
        (tmp_path / f"rank{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = ledger_table(tmp_path)
    # steps 1 and 2 averaged (step 0 left out), both ranks summed: 2 MB per step
    assert "rdp     inter-node  all_reduce               2.0         2.000" in table
    assert "init" in table


def test_report_shows_each_pipeline_rank_idle_fraction(tmp_path):
    """Step records with the pipeline engine's timing: 1 - compute / schedule time per rank, summed over
    the steps after the first, next to the schedule's bubble formula."""
    for rank, busy in ((0, 0.06), (1, 0.09)):
        rows = [{"step": i, "ops": [], "pipeline": {"wall_s": 0.5 if i == 0 else 0.1, "busy_s": busy,
                                                      "schedule": "zero_bubble", "bubble": "(2-1)(F+B-2W)"}}
                for i in range(3)]
        (tmp_path / f"rank{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    lines = ledger_table(tmp_path).splitlines()
    assert "pipeline idle per rank (zero_bubble, bubble (2-1)(F+B-2W);" in lines[-4]
    assert lines[-3].split() == ["rank", "steps", "schedule", "ms/step", "compute", "ms/step", "idle"]
    assert lines[-2].split() == ["0", "2", "100.0", "60.0", "40.0%"]
    assert lines[-1].split() == ["1", "2", "100.0", "90.0", "10.0%"]
