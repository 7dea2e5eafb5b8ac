"""``torch._six``: removed in torch 2.0, imported by the fp16/ helpers of the 2022 AWS GPT templates
(GPT-Neo, GPT-J, GPT-2 custom: ``from torch._six import inf``). The names torch 1.x had there."""

import collections.abc as container_abcs  # noqa: F401  (torch < 1.9 exported it)
import math
import sys

inf = math.inf
nan = math.nan
string_classes = (str, bytes)
int_classes = int
PY3 = sys.version_info[0] == 3
PY37 = sys.version_info[:2] >= (3, 7)


def with_metaclass(meta: type, *bases) -> type:
    """torch 1.x's six-style helper: a base class whose metaclass is ``meta``."""

    class Metaclass(meta):
        def __new__(cls, name, this_bases, d):
            return meta(name, bases, d)

    return type.__new__(Metaclass, "temporary_class", (), {})
