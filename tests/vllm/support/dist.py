"""Run a function on every tensor-parallel rank of a vLLM distributed environment.

At TP=1 the function runs in this process (the distributed environment is set up once and
kept); at TP>1 each rank is a fresh Python process (``python -m tests.vllm.support.dist``) that
joins a gloo group on 127.0.0.1 and saves what the function returns with ``torch.save``. The
parent loads the per-rank results with ``weights_only=True``.

A job is a module-level function ``job(rank, args) -> dict[str, Tensor]``; it runs inside
``set_current_vllm_config(VllmConfig())`` (a config without a model, under which vLLM creates
every process group, the expert-parallel one included).
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[3]
Results = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rank:
    """Where a job runs: its tensor-parallel rank and the world size."""

    rank: int
    world_size: int


Job = Callable[[Rank, Mapping[str, Any]], Results]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _init_distributed(rank: int, world_size: int, port: int) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    # The CPU communicator names its shared-memory segments after VLLM_DIST_IDENT.
    os.environ["VLLM_DIST_IDENT"] = f"patchctx-test-{port}"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=world_size,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(world_size)


def teardown_distributed() -> None:
    """Destroy vLLM's process groups and the torch world group, if any."""
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def ensure_single_rank() -> None:
    """Make this process a TP=1 world (kept until `teardown_distributed`)."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        size = get_tensor_model_parallel_world_size()
        assert size == 1, f"this process is already a TP={size} world"
        return
    teardown_distributed()  # a half-initialised world (e.g. left by an engine) goes first
    _init_distributed(0, 1, free_port())


def _call(job: Job, rank: Rank, args: Mapping[str, Any]) -> Results:
    from vllm.config import VllmConfig, set_current_vllm_config

    with torch.no_grad(), set_current_vllm_config(VllmConfig()):
        return job(rank, args)


def _job_reference(job: Job) -> str:
    module, qualname = job.__module__, job.__qualname__
    if "<" in qualname or module == "__main__":
        raise ValueError(f"a rank job must be a module-level function, got {module}.{qualname}")
    return f"{module}:{qualname}"


def _resolve(reference: str) -> Job:
    module, _, qualname = reference.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    job: Job = target
    return job


def run_tp(
    job: Job, world_size: int, args: Mapping[str, Any], *, timeout: float = 240.0
) -> list[Results]:
    """Run `job` on every rank of a TP=`world_size` world; return the results by rank.

    TP=1 runs in this process. TP>1 starts one process per rank; if any rank fails or the
    group does not finish within `timeout` seconds, every rank is killed and the error shows
    each rank's output.
    """
    if world_size == 1:
        ensure_single_rank()
        return [_call(job, Rank(0, 1), args)]

    reference = _job_reference(job)
    with tempfile.TemporaryDirectory(prefix="patchctx-tp-") as tmp:
        workdir = Path(tmp)
        (workdir / "args.pkl").write_bytes(pickle.dumps(dict(args)))
        port = free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        logs = [workdir / f"rank{r}.log" for r in range(world_size)]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for r in range(world_size):
                with open(logs[r], "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                __name__,
                                reference,
                                tmp,
                                str(r),
                                str(world_size),
                                str(port),
                            ],
                            cwd=ROOT,
                            env=env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                        )
                    )
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [p for p in procs if p.returncode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            report = "\n".join(
                f"--- rank {r} (exit {codes[r]}):\n{logs[r].read_text(errors='replace')[-6000:]}"
                for r in range(world_size)
            )
            raise AssertionError(f"TP={world_size} job {reference} failed:\n{report}")
        return [torch.load(workdir / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def _rank_main(argv: list[str]) -> int:
    reference, tmp, rank_s, world_s, port_s = argv
    rank, world_size = int(rank_s), int(world_s)
    torch.set_num_threads(1)
    workdir = Path(tmp)
    try:
        _init_distributed(rank, world_size, int(port_s))
        try:
            args = pickle.loads((workdir / "args.pkl").read_bytes())
            results = _call(_resolve(reference), Rank(rank, world_size), args)
            torch.save(results, workdir / f"rank{rank}.pt")
        finally:
            teardown_distributed()
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    # Run the canonical module's function, so that jobs and this runner share one `Rank` class.
    from tests.vllm.support.dist import _rank_main as rank_main

    sys.exit(rank_main(sys.argv[1:]))
