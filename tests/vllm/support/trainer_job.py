"""A trainer in its own process that dies in the middle of an update (SIGKILL, no clean-up).

``python -m tests.vllm.support.trainer_job URL NAME SHAPE_JSON [first|last]``: connects with
the ``patchctx`` trainer engine, starts an update, and sends a first chunk that is not the
last one (``first``, the default) or the whole update as its last chunk (``last``); then it
kills itself, before the rest or before ``finish_weight_update``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from patchctx.vllm import HTTPWeightSyncClient, PatchctxTrainerEngine, PatchctxTrainerInitInfo
from tests.vllm.support.patches import sparse


def main(argv: list[str]) -> int:
    url, name, shape = argv[0], argv[1], tuple(json.loads(argv[2]))
    last = len(argv) > 3 and argv[3] == "last"
    client = HTTPWeightSyncClient(url, timeout=60)
    engine = PatchctxTrainerEngine.trainer_init(
        PatchctxTrainerInitInfo(rank=0, inline_below=0, takeover=last), client=client
    )
    client.start_weight_update()
    engine.send_weight_chunk([sparse(name, shape, density=0.5, seed=4)], last=last)
    print("last chunk sent" if last else "first chunk sent", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
