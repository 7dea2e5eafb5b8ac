"""Bounds on what any input may ask for, checked before anything is built (one home).

They are far above any real job (smp v1 ran on a few hundred nodes of 8 GPUs) and keep a mistyped
or hostile input from making the translator, the launcher or ``smp.init`` run for minutes or
exhaust memory: every check runs in well under a second.
"""

from __future__ import annotations

import reprlib

#: processes in one job (512 nodes x 128 devices)
MAX_WORLD_SIZE = 65536
#: a parallelism degree or microbatch count cannot usefully exceed the world
MAX_DEGREE = MAX_WORLD_SIZE
#: bytes of an options / recipe / distribution file
MAX_FILE_BYTES = 1 << 20
#: nodes of an options document after YAML aliases are expanded
MAX_DOCUMENT_NODES = 100_000
#: nesting depth of an options document
MAX_DOCUMENT_DEPTH = 64

_quote = reprlib.Repr()
_quote.maxstring = _quote.maxother = 60
_quote.maxlist = _quote.maxtuple = _quote.maxdict = _quote.maxset = 6
_quote.maxlevel = 3


def quote(value) -> str:
    """repr() cut to a short prefix, in bounded time whatever the value (a huge or deeply nested
    structure is never walked whole)."""
    text = _quote.repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
