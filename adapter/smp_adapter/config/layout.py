"""Rank layout of SMP v1 (``placement_strategy``), as pure arithmetic.

SMP places every process on a 3-D grid of (rdp, pp, tp) coordinates. The
``placement_strategy`` is a 3-letter order ``XYZ`` over D (reduced data), P
(pipeline) and T (tensor); the right-most letter varies fastest over ascending
global ranks (as smp v1 places them)::

    rank = x * |Y| * |Z| + y * |Z| + z

Everything else (the five kinds of groups, ``dp_rank``, ``mp_rank``, the
sharding groups of sharded data parallelism, and the order strings handed to
Megatron-core and DeepSpeed) follows from that formula. This module holds only
that arithmetic, with no torch or engine import, so that the layout can be
checked exhaustively in unit tests and reused by whatever creates the real
process groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEMENT_ALIASES = {"cluster": "DPT", "spread": "TPD"}
VALID_ORDERS = ("DPT", "DTP", "PDT", "PTD", "TDP", "TPD")
GROUP_KINDS = ("tp", "pp", "rdp", "dp", "mp")

# Letter of the placement string -> RankCoord / RankGrid attribute.
_LETTER_AXIS = {"D": "rdp", "P": "pp", "T": "tp"}
# Letters that vary inside a group of each kind; the others are fixed.
# DP = same pp coordinate (TP x RDP); MP = same rdp coordinate (PP x TP).
_KIND_LETTERS = {"tp": "T", "pp": "P", "rdp": "D", "dp": "TD", "mp": "PT"}
# Token names the engines use for our letters. Megatron's "dp" and
# DeepSpeed's "data" are both our *reduced* data parallelism (RDP).
_MEGATRON_TOKEN = {"D": "dp", "P": "pp", "T": "tp"}
_DEEPSPEED_AXIS = {"D": "data", "P": "pipe", "T": "model"}


def placement_order(strategy: str) -> str:
    """Normalise a ``placement_strategy`` value to one of :data:`VALID_ORDERS`.

    Accepts the aliases ``cluster``/``spread`` and any permutation of the
    letters D, P, T, all case-insensitively, so that user configs written
    either way map to the same layout.
    """
    allowed = "'cluster', 'spread' or a permutation of 'D', 'P', 'T' (" + ", ".join(VALID_ORDERS) + ")"
    if not isinstance(strategy, str):
        raise ValueError(f"placement_strategy must be a string: {allowed}; got {strategy!r}")
    alias = PLACEMENT_ALIASES.get(strategy.lower())
    if alias is not None:
        return alias
    if strategy.upper() in VALID_ORDERS:
        return strategy.upper()
    raise ValueError(f"invalid placement_strategy {strategy!r}: expected {allowed}")


@dataclass(frozen=True)
class RankCoord:
    """Where one global rank sits: its grid coordinates and group positions."""

    rank: int
    rdp: int
    pp: int
    tp: int
    dp_rank: int  # position within its DP group (TP x RDP), ascending global rank
    mp_rank: int  # position within its MP group (PP x TP), ascending global rank


def _check_degree(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class RankGrid:
    """The SMP layout of ``world_size = pp * tp * rdp`` ranks under ``order``.

    Coordinates and groups are computed on request for the ranks asked about
    (``groups(kind)`` walks the world once); nothing is built for the whole world.
    """

    world_size: int
    pp: int
    tp: int
    rdp: int
    order: str  # one of VALID_ORDERS (aliases are normalised on construction)
    _size: dict = field(init=False, repr=False, compare=False)  # letter -> axis size
    _stride: dict = field(init=False, repr=False, compare=False)  # letter -> rank stride

    @classmethod
    def from_degrees(
        cls, world_size: int, pp: int = 1, tp: int = 1, placement: str = "cluster"
    ) -> "RankGrid":
        """Build the grid from the SMP config: rdp is whatever is left over."""
        for name, value in (("world size", world_size), ("pp", pp), ("tp", tp)):
            _check_degree(name, value)
        model_size = pp * tp
        if world_size % model_size != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by pipeline_parallel_degree (pp={pp}) * "
                f"tensor_parallel_degree (tp={tp}) = {model_size}"
            )
        return cls(world_size, pp, tp, world_size // model_size, placement)

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "tp", "rdp"):
            _check_degree(name, getattr(self, name))
        if self.pp * self.tp * self.rdp != self.world_size:
            raise ValueError(
                f"pp={self.pp} * tp={self.tp} * rdp={self.rdp} != world size {self.world_size}"
            )
        order = placement_order(self.order)
        object.__setattr__(self, "order", order)

        # Stride of each letter: the right-most letter has stride 1, each letter
        # to its left has the product of the sizes to its right.
        size = {letter: getattr(self, axis) for letter, axis in _LETTER_AXIS.items()}
        stride, step = {}, 1
        for letter in reversed(order):
            stride[letter] = step
            step *= size[letter]

        object.__setattr__(self, "_size", size)
        object.__setattr__(self, "_stride", stride)

    # Everything below is arithmetic on the asked-for ranks: nothing is materialised for the whole
    # world, so a grid of any (bounded) size costs nothing to build.
    def _along(self, rank: int, letter: str) -> int:
        """The rank's coordinate along a placement letter: (rank // stride) % size."""
        return (rank // self._stride[letter]) % self._size[letter]

    def _members(self, leader: int, varying: str) -> tuple[int, ...]:
        """The group whose leader (lowest rank) is ``leader``, its ``varying`` letters free."""
        offsets = [0]
        for letter in varying:
            offsets = [o + c * self._stride[letter] for o in offsets for c in range(self._size[letter])]
        return tuple(sorted(leader + o for o in offsets))

    @property
    def dp_size(self) -> int:
        """Processes holding the same pipeline stage: tp * rdp == world / pp."""
        return self.tp * self.rdp

    @property
    def mp_size(self) -> int:
        """Processes holding one model replica together: pp * tp."""
        return self.pp * self.tp

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is out of range for world size {self.world_size}")

    def coord(self, rank: int) -> RankCoord:
        """Coordinates and dp/mp positions of ``rank``.

        Within a DP (or MP) group the coordinate with the larger stride is the more significant
        digit of the ascending rank order, hence:
          dp_rank = tp * rdp_size + rdp   if T is left of D, else rdp * tp_size + tp
          mp_rank = tp * pp_size + pp     if T is left of P, else pp * tp_size + tp
        """
        self._check_rank(rank)
        rdp, pp, tp = (self._along(rank, letter) for letter in "DPT")
        t_before_d = self._stride["T"] > self._stride["D"]
        t_before_p = self._stride["T"] > self._stride["P"]
        return RankCoord(rank, rdp, pp, tp,
                         dp_rank=tp * self.rdp + rdp if t_before_d else rdp * self.tp + tp,
                         mp_rank=tp * self.pp + pp if t_before_p else pp * self.tp + tp)

    def rank_of(self, rdp: int, pp: int, tp: int) -> int:
        """Global rank at grid coordinates (rdp, pp, tp): the inverse of :meth:`coord`."""
        value = {"D": rdp, "P": pp, "T": tp}
        rank = 0
        for letter in self.order:  # Horner's rule: rank = (x * |Y| + y) * |Z| + z
            axis = _LETTER_AXIS[letter]
            limit = getattr(self, axis)
            if not 0 <= value[letter] < limit:
                raise ValueError(f"{axis} coordinate {value[letter]} is out of range [0, {limit})")
            rank = rank * limit + value[letter]
        return rank

    def _group(self, kind: str, rank: int) -> tuple[int, ...]:
        """A group is the set of ranks that agree on every coordinate *not* varied by its kind; its
        leader is the rank with the varied coordinates set to 0 (its lowest rank)."""
        self._check_rank(rank)
        varying = _KIND_LETTERS[kind]
        leader = rank - sum(self._along(rank, letter) * self._stride[letter] for letter in varying)
        return self._members(leader, varying)

    def tp_group(self, rank: int) -> tuple[int, ...]:
        """Ranks differing from ``rank`` only in the tp coordinate, ascending."""
        return self._group("tp", rank)

    def pp_group(self, rank: int) -> tuple[int, ...]:
        """Ranks differing from ``rank`` only in the pp coordinate, ascending."""
        return self._group("pp", rank)

    def rdp_group(self, rank: int) -> tuple[int, ...]:
        """Ranks differing from ``rank`` only in the rdp coordinate, ascending."""
        return self._group("rdp", rank)

    def dp_group(self, rank: int) -> tuple[int, ...]:
        """Ranks with the same pp coordinate as ``rank`` (TP x RDP), ascending."""
        return self._group("dp", rank)

    def mp_group(self, rank: int) -> tuple[int, ...]:
        """Ranks with the same rdp coordinate as ``rank`` (PP x TP), ascending."""
        return self._group("mp", rank)

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """All groups of ``kind`` (one of :data:`GROUP_KINDS`), sorted by first rank."""
        if kind not in _KIND_LETTERS:
            raise ValueError(f"unknown group kind {kind!r}: expected one of {', '.join(GROUP_KINDS)}")
        varying = _KIND_LETTERS[kind]
        leaders = (r for r in range(self.world_size) if all(self._along(r, letter) == 0 for letter in varying))
        return tuple(self._members(leader, varying) for leader in leaders)

    def sdp_groups(self, sdp: int) -> tuple[tuple[int, ...], ...]:
        """Sharding groups of sharded data parallelism with degree ``sdp``.

        Parameters are sharded across ranks that hold the same TP and PP
        shards, i.e. within an RDP group; each RDP group is cut into
        consecutive chunks of ``sdp`` ranks, and the chunks are replicas of
        each other (smp v1's documented example: 32 GPUs, tp=4, sdp=4 gives (0,4,8,12) and
        (16,20,24,28) for tp-rank 0). Sorted by first rank.
        """
        _check_degree("sharded_data_parallel_degree", sdp)
        if self.rdp % sdp != 0:
            raise ValueError(
                f"sharded_data_parallel_degree {sdp} does not divide the reduced data-parallel "
                f"degree rdp={self.rdp} (world size {self.world_size} / (pp={self.pp} * tp={self.tp}))"
            )
        chunks = [g[i : i + sdp] for g in self.groups("rdp") for i in range(0, self.rdp, sdp)]
        return tuple(sorted(chunks))

    def sdp_replica_groups(self, sdp: int) -> tuple[tuple[int, ...], ...]:
        """MiCS's replicas: within each RDP group, the ranks at the same place of every chunk of
        ``sdp_groups`` (the groups its gradient shards are all-reduced over). Sorted by first rank."""
        _check_degree("sharded_data_parallel_degree", sdp)
        return tuple(sorted(tuple(g[j::sdp]) for g in self.groups("rdp") for j in range(sdp)))

    def megatron_order(self) -> str:
        """``order`` for Megatron-core ``initialize_model_parallel`` giving this layout.

        Megatron's RankGenerator puts the *first* token of its order at stride
        1 (``global_rank = tp_rank + dp_rank * tp_size + pp_rank * tp_size *
        dp_size`` for "tp-dp-pp"), the opposite of SMP's right-most-fastest
        string, so the letters are reversed: ``cluster`` (DPT) -> "tp-pp-dp".
        Megatron's "dp" group is our RDP group, its "tp-dp" our DP group and
        its "tp-pp" our MP group. cp and ep are omitted: RankGenerator appends
        any missing token whose size is 1 (and raises if it is larger).
        """
        return "-".join(_MEGATRON_TOKEN[letter] for letter in reversed(self.order))

    def deepspeed_topology_axes(self) -> list[str]:
        """``axes`` for DeepSpeed ``ProcessTopology`` giving this layout.

        ProcessTopology is row-major (last axis fastest), the same convention
        as SMP, so the letters keep their order: ``cluster`` (DPT) ->
        ['data', 'pipe', 'model']. Pass ``dims`` in the same order.
        """
        return [_DEEPSPEED_AXIS[letter] for letter in self.order]

    def deepspeed_topology_dims(self) -> list[int]:
        """``dims`` matching :meth:`deepspeed_topology_axes`."""
        return [getattr(self, _LETTER_AXIS[letter]) for letter in self.order]
