"""The split backward's parameter groups (runtime/engines/pipeline/surgery.merged_param_groups): torch's
grouping can leave a weight used twice inside a stage in two groups (pytorch #180952), and the weight
step then adds its gradient twice. Nodes are stand-in objects here; the distributed tier runs the real
thing (test_pipeline_schedules.py, "sixtied" under ZB-H1 and zbv)."""

from smp_adapter.runtime.engines.pipeline.surgery import merged_param_groups


class Node:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


def test_groups_sharing_a_weight_become_one_with_both_intermediates():
    tied, w1, w2 = Node("tied"), Node("w1"), Node("w2")
    a, b = Node("a"), Node("b")
    groups = [{"params": {w1, tied}, "intermediates": [a], "grads": [("ga",)]},
              {"params": {tied, w2}, "intermediates": [b], "grads": [("gb",)]}]
    (merged,) = merged_param_groups(groups)
    assert merged["params"] == {tied, w1, w2}
    assert dict(zip(merged["intermediates"], merged["grads"])) == {a: ("ga",), b: ("gb",)}


def test_groups_sharing_an_intermediate_merge_and_keep_it_once():
    w1, w2, a, b = Node("w1"), Node("w2"), Node("a"), Node("b")
    groups = [{"params": {w1}, "intermediates": [a, b], "grads": [("ga",), ("gb",)]},
              {"params": {w2}, "intermediates": [b], "grads": [("gb",)]}]
    (merged,) = merged_param_groups(groups)
    assert merged["params"] == {w1, w2} and merged["intermediates"].count(b) == 1
    assert len(merged["intermediates"]) == len(merged["grads"]) == 2


def test_a_chain_of_overlaps_is_merged_transitively_and_disjoint_groups_are_kept():
    w = [Node(f"w{i}") for i in range(4)]
    x = [Node(f"x{i}") for i in range(4)]
    groups = [{"params": {w[0]}, "intermediates": [x[0]], "grads": [(0,)]},
              {"params": {w[1]}, "intermediates": [x[1]], "grads": [(1,)]},
              {"params": {w[0], w[1], w[2]}, "intermediates": [x[2]], "grads": [(2,)]},
              {"params": {w[3]}, "intermediates": [x[3]], "grads": [(3,)]}]
    merged = merged_param_groups(groups)
    assert sorted(len(g["params"]) for g in merged) == [1, 3]
    big = next(g for g in merged if len(g["params"]) == 3)
    assert sorted(big["intermediates"], key=repr) == x[:3] and sorted(g for (g,) in big["grads"]) == [0, 1, 2]
    # the input is not changed (torch's state keeps its own lists)
    assert groups[0]["params"] == {w[0]} and groups[2]["intermediates"] == [x[2]]
