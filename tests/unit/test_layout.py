"""Tests for smp_adapter.config.layout: the SMP v1 rank layout (spec section 3.1).

The spec tables are pasted verbatim from /work/shared/spec/smp-api.md and parsed,
so a mismatch points at the exact table cell. The engine tests build Megatron-core's
RankGenerator and DeepSpeed's ProcessTopology (neither needs torch.distributed) with
the order strings the module emits and compare their groups with ours.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import os
import re
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional

import pytest

from smp_adapter.config.layout import (
    GROUP_KINDS,
    PLACEMENT_ALIASES,
    VALID_ORDERS,
    RankCoord,
    RankGrid,
    placement_order,
)

# --------------------------------------------------------------------------------------
# Spec section 3.1 tables, verbatim.

SIX_STRATEGIES_8_GPUS = """
| 0 | 0,0,0 | 0,0,0 | 0,0,0 | 0,0,0 | 0,0,0 | 0,0,0 |
| 1 | 0,0,1 | 0,1,0 | 0,0,1 | 1,0,0 | 0,1,0 | 1,0,0 |
| 2 | 0,1,0 | 0,0,1 | 1,0,0 | 0,0,1 | 1,0,0 | 0,1,0 |
| 3 | 0,1,1 | 0,1,1 | 1,0,1 | 1,0,1 | 1,1,0 | 1,1,0 |
| 4 | 1,0,0 | 1,0,0 | 0,1,0 | 0,1,0 | 0,0,1 | 0,0,1 |
| 5 | 1,0,1 | 1,1,0 | 0,1,1 | 1,1,0 | 0,1,1 | 1,0,1 |
| 6 | 1,1,0 | 1,0,1 | 1,1,0 | 0,1,1 | 1,0,1 | 0,1,1 |
| 7 | 1,1,1 | 1,1,1 | 1,1,1 | 1,1,1 | 1,1,1 | 1,1,1 |
"""
SIX_STRATEGY_COLUMNS = ("DPT", "DTP", "PDT", "PTD", "TDP", "TPD")

CLUSTER_FULL = """
| 0 | 0 | 0 | 0 | 0 | 0 |
| 1 | 0 | 0 | 1 | 1 | 1 |
| 2 | 0 | 1 | 0 | 0 | 2 |
| 3 | 0 | 1 | 1 | 1 | 3 |
| 4 | 1 | 0 | 0 | 2 | 0 |
| 5 | 1 | 0 | 1 | 3 | 1 |
| 6 | 1 | 1 | 0 | 2 | 2 |
| 7 | 1 | 1 | 1 | 3 | 3 |
"""

# The cluster row is the prose line under the full cluster table, in table form.
GROUPS_8_GPUS = """
| DPT | {0,1},{2,3},{4,5},{6,7} | {0,2},{1,3},{4,6},{5,7} | {0,4},{1,5},{2,6},{3,7} | {0,1,4,5},{2,3,6,7} | {0,1,2,3},{4,5,6,7} |
| DTP | {0,2},{1,3},{4,6},{5,7} | {0,1},{2,3},{4,5},{6,7} | {0,4},{1,5},{2,6},{3,7} | {0,2,4,6},{1,3,5,7} | {0,1,2,3},{4,5,6,7} |
| PDT | {0,1},{2,3},{4,5},{6,7} | {0,4},{1,5},{2,6},{3,7} | {0,2},{1,3},{4,6},{5,7} | {0,1,2,3},{4,5,6,7} | {0,1,4,5},{2,3,6,7} |
| PTD | {0,2},{1,3},{4,6},{5,7} | {0,4},{1,5},{2,6},{3,7} | {0,1},{2,3},{4,5},{6,7} | {0,1,2,3},{4,5,6,7} | {0,2,4,6},{1,3,5,7} |
| TDP | {0,4},{1,5},{2,6},{3,7} | {0,1},{2,3},{4,5},{6,7} | {0,2},{1,3},{4,6},{5,7} | {0,2,4,6},{1,3,5,7} | {0,1,4,5},{2,3,6,7} |
| TPD | {0,4},{1,5},{2,6},{3,7} | {0,2},{1,3},{4,6},{5,7} | {0,1},{2,3},{4,5},{6,7} | {0,1,4,5},{2,3,6,7} | {0,2,4,6},{1,3,5,7} |
"""
GROUP_COLUMNS = ("tp", "pp", "rdp", "dp", "mp")


def _rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in table.strip().splitlines()]


def _parse_groups(cell: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(r) for r in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", cell))


def _grid8(order: str) -> RankGrid:
    return RankGrid.from_degrees(8, pp=2, tp=2, placement=order)


# --------------------------------------------------------------------------------------
# placement_order


@pytest.mark.parametrize(
    "strategy, expected",
    [("cluster", "DPT"), ("spread", "TPD"), ("CLUSTER", "DPT"), ("Spread", "TPD")]
    + [(o, o) for o in VALID_ORDERS]
    + [(o.lower(), o) for o in VALID_ORDERS]
    + [("tPd", "TPD")],
)
def test_placement_order_accepts(strategy, expected):
    assert placement_order(strategy) == expected


def test_aliases_match_spec():
    assert PLACEMENT_ALIASES == {"cluster": "DPT", "spread": "TPD"}
    assert sorted(VALID_ORDERS) == sorted("".join(p) for p in itertools.permutations("DPT"))


@pytest.mark.parametrize("bad", ["DPX", "cluster2", "", "DP", "DPTD", "DDP", " cluster", None, 3, ["D", "P", "T"]])
def test_placement_order_rejects(bad):
    with pytest.raises(ValueError, match=r"placement_strategy.*'cluster', 'spread'.*DPT, DTP, PDT, PTD, TDP, TPD"):
        placement_order(bad)


# --------------------------------------------------------------------------------------
# Spec tables


@pytest.mark.parametrize("column, order", list(enumerate(SIX_STRATEGY_COLUMNS)))
def test_six_strategy_coordinate_table(column, order):
    grid = _grid8(order)
    for row in _rows(SIX_STRATEGIES_8_GPUS):
        rank = int(row[0])
        rdp, pp, tp = (int(v) for v in row[1 + column].split(","))
        c = grid.coord(rank)
        assert (c.rdp, c.pp, c.tp) == (rdp, pp, tp), f"{order} rank {rank}"
        assert grid.rank_of(rdp, pp, tp) == rank


def test_cluster_full_table():
    grid = RankGrid.from_degrees(8, pp=2, tp=2)  # default placement is cluster
    assert grid.order == "DPT"
    for row in _rows(CLUSTER_FULL):
        rank, rdp, pp, tp, dp_rank, mp_rank = (int(v) for v in row)
        assert grid.coord(rank) == RankCoord(rank, rdp, pp, tp, dp_rank, mp_rank)


@pytest.mark.parametrize("row", _rows(GROUPS_8_GPUS), ids=lambda row: row[0])
def test_group_table(row):
    grid = _grid8(row[0])
    for kind, cell in zip(GROUP_COLUMNS, row[1:]):
        assert grid.groups(kind) == _parse_groups(cell), f"{row[0]} {kind}"


@pytest.mark.parametrize(
    "placement, pipeline_groups, dp_groups",
    [
        ("spread", ((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("cluster", ((0, 1), (2, 3), (4, 5), (6, 7)), ((0, 2, 4, 6), (1, 3, 5, 7))),
    ],
)
def test_no_tp_example(placement, pipeline_groups, dp_groups):
    grid = RankGrid.from_degrees(8, pp=2, placement=placement)
    assert grid.groups("pp") == pipeline_groups
    assert grid.groups("mp") == pipeline_groups  # tp == 1: the pipeline group is the MP group
    assert grid.groups("dp") == dp_groups


def test_no_tp_spread_dp_rank_of_process_6():
    assert RankGrid.from_degrees(8, pp=2, placement="spread").coord(6).dp_rank == 2


def test_sdp_tp_32_gpu_example():
    grid = RankGrid.from_degrees(32, tp=4)
    assert grid.rdp == 8
    assert grid.groups("tp") == tuple(tuple(range(s, s + 4)) for s in range(0, 32, 4))
    assert grid.rdp_group(0) == (0, 4, 8, 12, 16, 20, 24, 28)
    sdp = grid.sdp_groups(4)
    assert (0, 4, 8, 12) in sdp and (16, 20, 24, 28) in sdp
    assert len(sdp) == 8 and all(len(g) == 4 for g in sdp)
    # Every RDP group splits into consecutive chunks; the chunks of tp-rank 1 follow suit.
    assert (1, 5, 9, 13) in sdp and (17, 21, 25, 29) in sdp
    assert sorted(r for g in sdp for r in g) == list(range(32))


# --------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("world, pp, tp", [(12, 5, 1), (8, 3, 1), (8, 2, 3), (6, 4, 1), (4, 2, 4)])
def test_from_degrees_non_dividing_world(world, pp, tp):
    with pytest.raises(ValueError, match=rf"world size {world} .*pp={pp}.*tp={tp}"):
        RankGrid.from_degrees(world, pp=pp, tp=tp)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=8, pp=0), r"pp must be >= 1, got 0"),
    (dict(world_size=8, tp=-2), r"tp must be >= 1, got -2"),
    (dict(world_size=0), r"world size must be >= 1, got 0"),
])
def test_from_degrees_degree_below_one(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankGrid.from_degrees(**kwargs)


def test_from_degrees_non_int_degree():
    with pytest.raises(TypeError, match=r"pp must be an int, got '2'"):
        RankGrid.from_degrees(8, pp="2")


def test_from_degrees_bad_placement():
    with pytest.raises(ValueError, match=r"invalid placement_strategy 'DPX'"):
        RankGrid.from_degrees(8, placement="DPX")


def test_direct_construction_checks_product_and_normalises_alias():
    with pytest.raises(ValueError, match=r"pp=2 \* tp=2 \* rdp=3 != world size 8"):
        RankGrid(8, 2, 2, 3, "DPT")
    assert RankGrid(8, 2, 2, 2, "spread").order == "TPD"
    assert RankGrid(8, 2, 2, 2, "spread") == RankGrid.from_degrees(8, pp=2, tp=2, placement="TPD")


@pytest.mark.parametrize("rank", [-1, 8, 100, 1.0, True])
def test_rank_out_of_range(rank):
    grid = _grid8("DPT")
    with pytest.raises(ValueError, match=r"rank .* out of range for world size 8"):
        grid.coord(rank)
    with pytest.raises(ValueError, match=r"out of range for world size 8"):
        grid.dp_group(rank)


@pytest.mark.parametrize("coords, match", [((2, 0, 0), r"rdp coordinate 2"), ((0, -1, 0), r"pp coordinate -1"),
                                           ((0, 0, 2), r"tp coordinate 2")])
def test_rank_of_out_of_range(coords, match):
    with pytest.raises(ValueError, match=match):
        _grid8("DPT").rank_of(*coords)


def test_unknown_group_kind():
    with pytest.raises(ValueError, match=r"unknown group kind 'ep'.*tp, pp, rdp, dp, mp"):
        _grid8("DPT").groups("ep")


@pytest.mark.parametrize("sdp, match", [(3, r"sharded_data_parallel_degree 3 does not divide .*rdp=8"),
                                        (0, r"sharded_data_parallel_degree must be >= 1")])
def test_sdp_errors(sdp, match):
    with pytest.raises(ValueError, match=match):
        RankGrid.from_degrees(32, tp=4).sdp_groups(sdp)


# --------------------------------------------------------------------------------------
# Properties over every factorisation world = pp * tp * rdp, world 1..64, all orders.


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SHAPES = [(world, pp, tp) for world in range(1, 65) for pp in _divisors(world) for tp in _divisors(world // pp)]


# Which of the (rdp, pp, tp) coordinates stay fixed inside a group of each kind.
FIXED_COORDS = {"tp": (0, 1), "pp": (0, 2), "rdp": (1, 2), "dp": (1,), "mp": (0,)}


def _check_properties(grid: RankGrid) -> None:
    n, pp, tp, rdp = grid.world_size, grid.pp, grid.tp, grid.rdp
    everyone = list(range(n))
    # Identities of spec section 2.3.
    assert grid.mp_size * rdp == n and pp * grid.dp_size == n and pp * tp * rdp == n
    assert grid.dp_size == n // pp and grid.mp_size == pp * tp

    coords = [grid.coord(r) for r in everyone]
    cells = [(c.rdp, c.pp, c.tp) for c in coords]
    assert all(c.rank == r for r, c in enumerate(coords))
    assert sorted(cells) == [(d, p, t) for d in range(rdp) for p in range(pp) for t in range(tp)]  # a bijection
    assert [grid.rank_of(*cell) for cell in cells] == everyone

    sizes = {"tp": tp, "pp": pp, "rdp": rdp, "dp": tp * rdp, "mp": pp * tp}
    lookup = {"tp": grid.tp_group, "pp": grid.pp_group, "rdp": grid.rdp_group, "dp": grid.dp_group, "mp": grid.mp_group}
    for kind in GROUP_KINDS:
        groups = grid.groups(kind)
        assert sorted(r for g in groups for r in g) == everyone, kind  # a partition of the world
        assert [g[0] for g in groups] == sorted(g[0] for g in groups), kind
        for g in groups:
            assert len(g) == sizes[kind] and list(g) == sorted(g), (kind, g)
            # Members agree on the fixed coordinates; being sizes[kind] distinct cells, they
            # then cover every value of the varied ones.
            assert len({tuple(cells[r][i] for i in FIXED_COORDS[kind]) for r in g}) == 1, (kind, g)
            for position, r in enumerate(g):
                assert lookup[kind](r) == g, (kind, r)
                if kind == "dp":
                    assert coords[r].dp_rank == position, r
                if kind == "mp":
                    assert coords[r].mp_rank == position, r

    for g in grid.groups("tp"):  # the TP group is a subset of the DP group (and of the MP group)
        assert set(g) <= set(grid.dp_group(g[0])) and set(g) <= set(grid.mp_group(g[0]))
    for g in grid.groups("rdp"):
        assert set(g) <= set(grid.dp_group(g[0]))
    for g in grid.groups("pp"):
        assert set(g) <= set(grid.mp_group(g[0]))
    if pp == 1:
        assert grid.groups("tp") == grid.groups("mp")
    if tp == 1:
        assert grid.groups("pp") == grid.groups("mp")

    for sdp in _divisors(rdp):  # sharding groups: consecutive slices of the RDP groups
        chunks = grid.sdp_groups(sdp)
        assert sorted(r for g in chunks for r in g) == everyone, sdp
        for g in chunks:
            rdp_g = grid.rdp_group(g[0])
            start = rdp_g.index(g[0])
            assert start % sdp == 0 and g == rdp_g[start : start + sdp], (sdp, g)


@pytest.mark.parametrize("order", VALID_ORDERS)
def test_properties_all_factorisations(order):
    # One test per order (not per shape): ~800 shapes each, pytest overhead would dominate.
    for world, pp, tp in SHAPES:
        grid = RankGrid.from_degrees(world, pp=pp, tp=tp, placement=order)
        try:
            _check_properties(grid)
        except AssertionError as exc:
            raise AssertionError(f"{grid}: {exc}") from exc


def test_large_world_is_fast():
    import time

    start = time.process_time()  # CPU seconds: the machine's load must not fail it
    grid = RankGrid.from_degrees(4096, pp=8, tp=8, placement="TDP")
    assert grid.coord(4095) == RankCoord(4095, 63, 7, 7, 511, 63)
    assert len(grid.groups("dp")) == 8
    assert time.process_time() - start < 2.0


# --------------------------------------------------------------------------------------
# The engines agree: Megatron-core RankGenerator and DeepSpeed ProcessTopology.
#
# Both classes are pure Python and need no torch.distributed, but importing their modules
# costs ~4 s (megatron.core.__init__ pulls in torch and the transformer stack; deepspeed pulls
# in torch and an accelerator). To keep this file fast we compile the *installed* source of
# just those definitions (found with importlib.util.find_spec, which does not import the
# package) and execute it unchanged; if an engine renames or rewires them, the extraction
# fails loudly. SMP_ADAPTER_REAL_ENGINE_IMPORT=1 imports the real modules instead.


def _engine_defs(package: str, relpath: str, module: str, names: tuple[str, ...], namespace: dict) -> SimpleNamespace:
    if os.environ.get("SMP_ADAPTER_REAL_ENGINE_IMPORT") == "1":
        mod = pytest.importorskip(module)
        return SimpleNamespace(**{name: getattr(mod, name) for name in names})
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relpath
    tree = ast.parse(path.read_text(), str(path))
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    found = {n.name for n in nodes}
    if found != set(names):
        pytest.fail(f"{path} no longer defines {sorted(set(names) - found)}: re-verify the layout mapping")
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return SimpleNamespace(**{name: namespace[name] for name in names})


def _megatron():
    return _engine_defs(
        "megatron", "core/parallel_state.py", "megatron.core.parallel_state",
        ("generate_masked_orthogonal_rank_groups", "RankGenerator"), {"List": List, "Optional": Optional},
    )


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a real deepspeed import picks an accelerator
    return _engine_defs(
        "deepspeed", "runtime/pipe/topology.py", "deepspeed.runtime.pipe.topology",
        ("ProcessTopology",), {"namedtuple": namedtuple, "cartesian_product": itertools.product},
    )


ENGINE_SHAPES = [(2, 2, 2), (2, 3, 4), (4, 1, 3), (1, 4, 2), (3, 2, 1), (1, 1, 5), (2, 4, 4), (1, 1, 1)]  # pp, tp, rdp


def _as_partition(groups) -> list[tuple[int, ...]]:
    return sorted(tuple(sorted(g)) for g in groups)


@pytest.mark.parametrize("order", VALID_ORDERS)
def test_megatron_rank_generator_matches(order):
    parallel_state = _megatron()
    expected = {"cluster": "tp-pp-dp", "spread": "dp-pp-tp"}
    for pp, tp, rdp in ENGINE_SHAPES:
        grid = RankGrid.from_degrees(pp * tp * rdp, pp=pp, tp=tp, placement=order)
        m_order = grid.megatron_order()
        assert m_order == "-".join({"D": "dp", "P": "pp", "T": "tp"}[c] for c in reversed(order))
        gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=rdp, pp=pp, cp=1, order=m_order)
        # Megatron "dp" is our RDP; its "tp-dp" is our DP and its "tp-pp" our MP.
        for token, kind in (("tp", "tp"), ("pp", "pp"), ("dp", "rdp"), ("tp-dp", "dp"), ("tp-pp", "mp")):
            assert _as_partition(gen.get_ranks(token)) == list(grid.groups(kind)), (order, pp, tp, rdp, token)
    for alias, m_order in expected.items():
        assert RankGrid.from_degrees(8, 2, 2, alias).megatron_order() == m_order


@pytest.mark.parametrize("order", VALID_ORDERS)
def test_deepspeed_process_topology_matches(order):
    topology = _deepspeed()
    for pp, tp, rdp in ENGINE_SHAPES:
        grid = RankGrid.from_degrees(pp * tp * rdp, pp=pp, tp=tp, placement=order)
        axes = grid.deepspeed_topology_axes()
        assert axes == [{"D": "data", "P": "pipe", "T": "model"}[c] for c in order]
        topo = topology.ProcessTopology(axes=axes, dims=grid.deepspeed_topology_dims())
        for axis, kind in (("model", "tp"), ("pipe", "pp"), ("data", "rdp")):
            assert _as_partition(topo.get_axis_comm_lists(axis)) == list(grid.groups(kind)), (order, axis)
        for rank in range(grid.world_size):
            c = grid.coord(rank)
            assert topo.get_rank(data=c.rdp, pipe=c.pp, model=c.tp) == rank
    assert RankGrid.from_degrees(8, 2, 2).deepspeed_topology_axes() == ["data", "pipe", "model"]
    assert RankGrid.from_degrees(8, 2, 2, "spread").deepspeed_topology_axes() == ["model", "pipe", "data"]
