"""ZeRO-3's parameter gathers in one optimizer step, by the rules of DeepSpeed 0.19.8's parameter
coordinator (deepspeed/runtime/zero/partitioned_param_coordinator.py), replayed over the module trace
plan builds from a ModelSpec. Pure arithmetic, no torch.

What the coordinator does, as modelled here (facts read from that file):
* The trace: the order modules are fetched in during one forward and backward (a forward's start
  resets it: each microbatch is one pass), and from it the order of their parameters, each with the
  trace step of that use. A tied weight (GPT-2's wte, used again by the head) appears at each use.
* Fetch: a module's parameters not gathered are gathered in one call (coalesced); then the queue of
  parameters in trace order is advanced past this use and up to prefetch_bucket_size elements of later
  parameters not gathered are gathered in one more call (no more than max_live_parameters gathered in
  all); the parameters the prefetcher passes over because they are gathered are marked used at that
  later step.
* Release after a module's forward or backward: each of its parameters is kept when a later use was
  marked by the prefetcher, or when it is used again by a module that starts within
  max_reuse_distance elements of the trace (counting every module's parameters from the next one);
  otherwise it is partitioned again.
* Activation checkpointing: a block's recompute runs its forward modules again in backward, right
  before the block's backward: released parameters are gathered again for the recompute, and the
  backward then finds them gathered.
* hpZ: the first gather of a parameter in an optimizer step reads the primary partition (all rdp
  ranks) and builds the node-local copy; later ones read that copy (the sdp group). A call holding
  both kinds is two calls.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

FORWARD, BACKWARD = "forward", "backward"
PRIMARY, SECONDARY = "primary", "secondary"


@dataclass(frozen=True)
class Use:
    params: tuple  # ids of the module's gathered (non-persistent) parameters
    forward: bool  # a forward (or recompute) fetch; else a backward one
    phase: str  # FORWARD or BACKWARD: the part of the pass it runs in


@dataclass
class Gathers:
    """(phase, source) -> [calls, elements] per optimizer step; peak: the most elements gathered at once
    (parameters kept whole left out); reduce_calls: the gradients' reduce-scatters per optimizer step."""
    counts: dict = field(default_factory=dict)
    peak: int = 0
    reduce_calls: int = 0

    def add(self, phase: str, source: str, numel: int) -> None:
        entry = self.counts.setdefault((phase, source), [0, 0])
        entry[0] += 1
        entry[1] += numel


LAYERS, TIED = "layers", "tied"


def default_trees(spec) -> tuple[tuple, tuple]:
    """(model tree, layer tree) where the spec gives none: the model's own module around one module per
    embedding table, the layers, one module per other tensor outside them and, tied, the head; a layer's
    own module around one module per tensor. A tree node: (tensors, children), tensors a count of the
    next tensors of the list (outer_tensors for the model, layer_tensors for a layer), LAYERS (the
    layers go here) or TIED (the head, reading the first outer tensor: the vocabulary table, again)."""
    first = 1 + spec.position_tables if spec.vocab else 1
    rest = len(spec.outer_tensors) - first
    head = ((TIED, ()),) if spec.tied_embeddings and spec.vocab else ()
    model = (0, ((1, ()),) * first + ((LAYERS, ()),) + ((1, ()),) * rest + head)
    return model, (0, ((1, ()),) * len(spec.layer_tensors))


class _Tree:
    """Walks module trees into the trace's Uses and a pass's events. Forward: a module's pre-forward hook
    before its children's, its release after them. Backward: a module's pre-backward hook fires when
    its output's gradient is ready, before its children's (the last child's output is its output): the
    children in reverse, each release after the module's children again."""

    def __init__(self):
        self.uses, self.events, self.numel = [], [], []

    def fetch(self, params, forward, phase) -> int:
        self.uses.append(Use(tuple(params), forward, phase))
        self.events.append(("fetch", len(self.uses) - 1))
        return len(self.uses) - 1

    def assign(self, node, tensors: list[int], taken: list, layers: list) -> tuple:
        """The node with its parameter ids: (ids, children); the layers' nodes are given in ``layers``."""
        kind, children = node
        if kind == LAYERS:
            return LAYERS, tuple(layers)
        if kind == TIED:
            return ((0,), ())
        ids = tuple(range(len(self.numel), len(self.numel) + kind))
        self.numel += [tensors[taken[0] + i] for i in range(kind)]
        taken[0] += kind
        return ids, tuple(self.assign(c, tensors, taken, layers) for c in children)

    def walk(self, node, forward: bool, phase: str, checkpointing: bool = False) -> None:
        ids, children = node
        order = children if forward else tuple(reversed(children))
        if ids == LAYERS:
            for layer in order:
                if checkpointing and not forward:
                    self.checkpointed_backward(layer)
                else:
                    self.walk(layer, forward, phase)
            return
        index = self.fetch(ids, forward, phase)
        for child in order:
            self.walk(child, forward, phase, checkpointing)
        self.events.append(("release", index))

    def checkpointed_backward(self, layer) -> None:
        """The layer's backward hooks fire down to the first module with parameters, whose backward
        unpacks the saved tensors: the layer's forward runs again (in the backward), then the rest."""
        start = len(self.events)
        self.walk(layer, False, BACKWARD)
        events, self.events = self.events[start:], self.events[:start]
        first = next((i for i, (kind, u) in enumerate(events) if kind == "fetch" and self.uses[u].params), None)
        if first is None:
            self.events += events
            return
        self.events += events[:first + 1]
        self.walk(layer, True, BACKWARD)
        self.events += events[first + 1:]


def trace(spec, layer_numel: list[int], outer_numel: list[int], layers: int, checkpointing: bool):
    """(numel by parameter id, the Uses of one pass in trace order, the pass's events: ("fetch" | "release",
    index of the Use)): the model's tree (ModelSpec.model_modules, else default_trees) forward, then
    backward, each checkpointed layer's forward run again inside its backward."""
    model, layer = default_trees(spec)
    model, layer = getattr(spec, "model_modules", ()) or model, getattr(spec, "layer_modules", ()) or layer
    tree = _Tree()
    root = tree.assign(model, outer_numel, [0], [])
    blocks = tuple(tree.assign(layer, layer_numel, [0], []) for _ in range(layers))
    root = _with_layers(root, blocks)
    tree.walk(root, True, FORWARD)
    tree.walk(root, False, BACKWARD, checkpointing)
    order = [u for kind, u in tree.events if kind == "fetch"]  # the trace: the fetches as they run
    position = {u: i for i, u in enumerate(order)}
    return tree.numel, [tree.uses[u] for u in order], [(kind, position[u]) for kind, u in tree.events]


def _with_layers(node, blocks):
    ids, children = node
    if ids == LAYERS:
        return ids, blocks
    return ids, tuple(_with_layers(c, blocks) for c in children)


class Coordinator:
    """The passes of one optimizer step through the trace, with the coordinator's state of each pass,
    and what they gather. Persistent parameters (below the persistence threshold) are always gathered:
    never fetched nor released, but in the trace, so counted in the reuse distance."""

    def __init__(self, numel: list[int], persistent: set, uses: list, events: list, buffers: dict, hpz: bool):
        self.numel, self.persistent, self.uses, self.events, self.hpz = numel, set(persistent), uses, events, hpz
        self.reach = buffers["stage3_max_reuse_distance"]
        self.max_live = buffers["stage3_max_live_parameters"]
        self.bucket = buffers["stage3_prefetch_bucket_size"]
        self.available, self.ever, self.gathers = set(persistent), set(), Gathers()
        self.reach_from = {}  # step -> within_reach(step), the same in every pass

    def run_passes(self, n: int) -> None:
        """n passes; a pass that starts as the one before it did gathers what that one gathered."""
        before, last = None, None
        for done in range(n):
            start = (frozenset(self.available), frozenset(self.ever))
            if start == before:
                for key, (calls, numel) in last.items():
                    self.gathers.counts[key][0] += calls * (n - done)
                    self.gathers.counts[key][1] += numel * (n - done)
                return
            counts = {k: list(v) for k, v in self.gathers.counts.items()}
            self.run_pass()
            before = start
            last = {k: (v[0] - counts.get(k, [0, 0])[0], v[1] - counts.get(k, [0, 0])[1])
                    for k, v in self.gathers.counts.items()}

    def run_pass(self) -> None:
        """One forward and backward: the trace's parameter queue and the prefetcher's marks start again,
        the count of gathered elements at 0 (what stays gathered from the last pass stays gathered)."""
        self.queue = deque((p, step) for step, use in enumerate(self.uses) for p in sorted(set(use.params)))
        self.marked, self.live, step = {}, 0, 0
        for kind, index in self.events:
            if kind == "fetch":
                self.fetch(step, self.uses[index])
                step += 1  # the trace's step: one per fetch
            else:
                self.release(step, self.uses[index])

    def _gather(self, ids, phase: str) -> None:
        ids = [p for p in dict.fromkeys(ids) if p not in self.available]
        secondary = [p for p in ids if self.hpz and p in self.ever]
        for part, source in ((ids if not secondary else [p for p in ids if p not in self.ever], PRIMARY),
                             (secondary, SECONDARY)):
            if part:
                self.gathers.add(phase, source, sum(self.numel[p] for p in part))
        self.available.update(ids)
        self.ever.update(ids)
        self.live += sum(self.numel[p] for p in ids)
        held = sum(self.numel[p] for p in self.available - self.persistent)
        self.gathers.peak = max(self.gathers.peak, held)

    def fetch(self, step: int, use: Use) -> None:
        """Gather the module's parameters, advance the queue past this use, prefetch what follows."""
        self._gather(use.params, use.phase)
        own = {p for p in use.params if self.marked.get(p, -1) < step}
        popped = set()
        while self.queue and len(popped) < len(own):
            p, at = self.queue.popleft()
            self.marked[p] = at
            popped.add(p)
        budget, chosen, numel = min(self.max_live - self.live, self.bucket), [], 0
        while self.queue and numel < budget:
            p, at = self.queue.popleft()
            self.marked[p] = max(self.marked.get(p, -1), at)
            if p not in self.available and p not in chosen:
                chosen.append(p)
                numel += self.numel[p]
        if chosen:
            self._gather(chosen, use.phase)

    def within_reach(self, step: int) -> set:
        """The parameters of the modules from ``step`` on that start within max_reuse_distance elements."""
        if step not in self.reach_from:
            found, traversed = set(), 0
            for later in self.uses[step:]:
                if traversed >= self.reach:
                    break
                found.update(later.params)
                traversed += sum(self.numel[p] for p in later.params)
            self.reach_from[step] = found
        return self.reach_from[step]

    def release(self, step: int, use: Use) -> None:
        """After the module ran (``step``: the next use's): partition again what is not used soon."""
        keep = {p for p in use.params if self.marked.get(p, -1) > step} | self.persistent
        for p in set(use.params) - keep - self.within_reach(step):
            if p in self.available:
                self.available.discard(p)
                self.live -= self.numel[p]


def gathers(spec, dims, job, buffers: dict, persistent) -> Gathers:
    """What one optimizer step of n = m k passes gathers (persistent(numel) says which tensors stay
    whole), pp = 1 or one pipeline stage's layers with every tensor outside them. The coordinator is
    replayed for a spec that gives its module trees (ModelSpec.model_modules, layer_modules: GPT-2, checked
    against the ledger); for the others, whose modules plan does not know (one module per tensor would
    make every bias a prefetch of its own), the reuse rule by layer depth (released_fraction)."""
    if not (spec.model_modules and spec.layer_modules):
        return by_depth(spec, dims, job, buffers, persistent)
    t = dims.tp
    size = lambda n, split: n // t if split and t > 1 else n  # noqa: E731
    layer = [size(n, s) for n, s in spec.layer_tensors]
    outer = [size(n, s) for n, s in spec.outer_tensors]
    layers = math.ceil(spec.layers / dims.pp)
    numel, uses, events = trace(spec, layer, outer, layers, job.activation_checkpointing)
    kept = {p for p, n in enumerate(numel) if persistent(n)}
    coordinator = Coordinator(numel, kept, uses, events, buffers, dims.hpz_partition_size > 1)
    passes = dims.cfg.microbatches * job.accumulation
    coordinator.run_passes(passes)
    coordinator.gathers.reduce_calls = passes * reduce_calls(numel, uses, buffers["reduce_bucket_size"])
    return coordinator.gathers


def reduce_calls(numel: list[int], uses: list, bucket: int) -> int:
    """The reduce-scatters of one pass: each gradient joins the reduce bucket when its parameter's
    backward is done (a tied weight's once, at its last use: autograd sums its uses' gradients first), in
    the backward's order; the bucket is reduced before a gradient that would take it past
    reduce_bucket_size elements, and at the end (DeepSpeed's stage3 reduce_independent_p_g_buckets_...)."""
    last = {}
    for step, use in enumerate(uses):
        if not use.forward:
            for p in sorted(set(use.params)):
                last[p] = step
    calls, held = 0, 0
    for p in sorted(last, key=lambda p: (last[p], p)):
        if held and held + numel[p] > bucket:
            calls, held = calls + 1, 0
        held += numel[p]
    return calls + (1 if held else 0)


def released_fraction(gathered_numel: int, buffers: dict) -> float:
    """Share of the gathered parameters released between a layer's forward and its backward, by depth:
    a layer at depth i of N elements is used again after about 2 (N - i) elements, so the last R / 2
    elements of the model stay gathered (R: the reuse distance, within max_live_parameters)."""
    reach = min(buffers["stage3_max_reuse_distance"], buffers["stage3_max_live_parameters"])
    if gathered_numel <= 0:
        return 0.0
    return max(0.0, 1.0 - reach / (2 * gathered_numel))


def by_depth(spec, dims, job, buffers: dict, persistent) -> Gathers:
    """The gathers without module trees: the first forward gathers every parameter, the released share
    is gathered again by every later pass (n - 1 forwards, n backwards; hpZ's from the node copy), one
    call per layer and one for the tensors outside them per pass; ceil(params / reduce bucket)
    reduce-scatters per microbatch; at least two layers gathered at once."""
    t, n = dims.tp, dims.cfg.microbatches * job.accumulation
    size = lambda x, split: x // t if split and t > 1 else x  # noqa: E731
    layer = [size(x, s) for x, s in spec.layer_tensors]
    layers = math.ceil(spec.layers / dims.pp)
    tensors = layer * layers + [size(x, s) for x, s in spec.outer_tensors]
    gathered = sum(x for x in tensors if not persistent(x))
    released = gathered * released_fraction(gathered, buffers)
    per_pass, out = 1 + layers, Gathers()
    if dims.hpz_partition_size > 1:
        out.counts = {(FORWARD, PRIMARY): [per_pass, gathered], (FORWARD, SECONDARY): [per_pass * (n - 1), released * (n - 1)],
                      (BACKWARD, SECONDARY): [per_pass * n, released * n]}
    else:
        out.counts = {(FORWARD, PRIMARY): [per_pass * n, gathered + released * (n - 1)],
                      (BACKWARD, PRIMARY): [per_pass * n, released * n]}
    one_layer = sum(x for x in layer if not persistent(x))
    out.peak = int(max(gathered - released, min(2 * one_layer, gathered)))
    out.reduce_calls = max(1, math.ceil(sum(tensors) / buffers["reduce_bucket_size"])) * n
    return out
