"""The job's environment, carried to the ranks on other hosts as one variable.

DeepSpeed's multi-node runner (pdsh) forwards a variable to remote ranks only if its name has one of a
few prefixes or it is listed in a ``.deepspeed_env`` file, and it writes each as ``export K=V`` in the
remote shell command, wrapping a value holding anything beyond ``[\\w@%+=:,./-]`` in double quotes.
JSON values with quotes and spaces (SM_HP_MP_PARAMETERS, SM_HPS, SM_TRAINING_ENV) do not survive
that. So ``smp-adapter launch`` writes a deepspeed_env file (named by DS_ENV_FILE) holding the plain
variables as themselves and every variable in ``SMP_ADAPTER_ENV_B64`` (base64 of a JSON object,
whose alphabet passes unquoted); importing ``smdistributed.modelparallel`` on a rank unpacks it,
keeping any variable the rank already has.
"""

from __future__ import annotations

import base64
import json
import os
import re
from typing import Mapping, MutableMapping

BUNDLE = "SMP_ADAPTER_ENV_B64"
_PASSES_UNQUOTED = re.compile(r"[\w@%+=:,./-]*")


def pack(env: Mapping[str, str]) -> str:
    return base64.b64encode(json.dumps(dict(env), sort_keys=True).encode()).decode()


def deepspeed_env_file(env: Mapping[str, str]) -> str:
    """The text of a deepspeed_env file that brings ``env`` to every remote rank."""
    plain = [f"{k}={v}" for k, v in env.items() if _PASSES_UNQUOTED.fullmatch(v) and "\n" not in v]
    return "\n".join([*plain, f"{BUNDLE}={pack(env)}"]) + "\n"


def unpack_into(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the bundled variables this process does not have yet (a rank's own values win)."""
    raw = environ.get(BUNDLE)
    if not raw:
        return
    try:
        bundled = json.loads(base64.b64decode(raw.strip().strip('"'), validate=True))
    except ValueError:
        raise RuntimeError(f"{BUNDLE} is not the base64 JSON smp-adapter launch writes: unset it, or launch again "
                           "with smp-adapter launch") from None
    for name, value in bundled.items():
        environ.setdefault(name, value)
