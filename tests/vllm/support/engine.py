"""vLLM engines on tiny checkpoints, greedy generation from token ids, and the HF reference.

`start_llm` starts ``vllm.LLM`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine
core and its single worker run in this process) or multi-process (the engine core and worker
in a spawned process; the CPU platform forces ``spawn``). `vllm_greedy` and `hf_greedy` produce
comparable `Generation`s: the greedy tokens and the log-probability of each chosen token.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAX_TOKENS = 8
PROMPTS: tuple[tuple[int, ...], ...] = ((1, 17, 42, 99, 3), (150, 7, 7, 64), (5,))


@dataclass(frozen=True)
class Generation:
    """Greedy continuation of one prompt: the tokens and each chosen token's log-probability."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


EXTENSION = "tests.vllm.support.extension.LaneWorkerExtension"


@contextlib.contextmanager
def engine_env(*, multiprocess: bool, extra: dict[str, str] | None = None) -> Iterator[None]:
    """Environment variables an engine reads at start-up, set for the block and then restored.

    Also switches TorchDynamo off (``TORCHDYNAMO_DISABLE=1`` for spawned processes, the config
    flag in this one): with ``logprobs`` requested, vLLM's sampler compiles a helper on first
    use, 10-20 s on a cold inductor cache, for nothing these tests need.
    """
    import torch._dynamo

    values = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; the default would take much more
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
        "TORCHDYNAMO_DISABLE": "1",
        **(extra or {}),
    }
    saved = {key: os.environ.get(key) for key in values}
    dynamo_was_disabled = torch._dynamo.config.disable
    os.environ.update(values)
    torch._dynamo.config.disable = True
    try:
        yield
    finally:
        torch._dynamo.config.disable = dynamo_was_disabled
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def running_engine(
    model_dir: Path,
    *,
    multiprocess: bool = False,
    keep_layout: bool = False,
    worker_extension_cls: str | None = EXTENSION,
    **options: Any,
) -> Iterator[Any]:
    """A started ``vllm.LLM`` on `model_dir`, shut down (process groups released) on exit.

    `keep_layout` switches the CPU backend's prepacking of dense linear and embedding weights
    off (``patchctx.vllm.keep_checkpoint_layout``) while the engine starts in this process or,
    for a multi-process engine, in its worker process (``PATCHCTX_VLLM_KEEP_CHECKPOINT_LAYOUT=1``
    in the environment the worker inherits; the worker applies it when it imports
    ``patchctx.vllm`` to resolve the extension).
    """
    from vllm.v1.worker.cpu_worker import CPUWorker

    from patchctx.vllm import keep_checkpoint_layout
    from patchctx.vllm._layout import KEEP_LAYOUT_ENV
    from tests.vllm.support.dist import teardown_distributed

    extra = {KEEP_LAYOUT_ENV: "1"} if keep_layout and multiprocess else None
    keeping = keep_checkpoint_layout() if keep_layout and not multiprocess else None
    # vLLM adds a worker extension to the worker class's bases for good: an in-process engine
    # gets the class back as vLLM made it on exit, so a later engine of this process may use
    # another extension (as a fresh process would).
    bases = CPUWorker.__bases__
    with engine_env(multiprocess=multiprocess, extra=extra):
        if not multiprocess:
            teardown_distributed()  # the in-process worker builds its own TP=1 world
        try:
            with keeping or contextlib.nullcontext():
                llm = start_llm(model_dir, worker_extension_cls=worker_extension_cls, **options)
            try:
                yield llm
            finally:
                shutdown_llm(llm)
        finally:
            CPUWorker.__bases__ = bases


def start_llm(
    model_dir: Path,
    *,
    worker_extension_cls: str | None = None,
    tensor_parallel_size: int = 1,
    **options: Any,
) -> Any:
    """``vllm.LLM`` on the tiny checkpoint at `model_dir` (call inside `engine_env`)."""
    from vllm import LLM

    from tests.vllm.support.checkpoints import inspect_models_in_process

    inspect_models_in_process()
    kwargs: dict[str, Any] = {}
    if worker_extension_cls is not None:
        kwargs["worker_extension_cls"] = worker_extension_cls
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        tensor_parallel_size=tensor_parallel_size,
        seed=0,
        **kwargs,
        **options,
    )


def shutdown_llm(llm: Any) -> None:
    """Stop the engine and release vLLM's process groups in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    client = llm.llm_engine.engine_core
    client.shutdown()
    # The multi-process client leaves its ZMQ context open (a ResourceWarning when collected,
    # an error under filterwarnings=error); its sockets are closed by now.
    context = getattr(client, "ctx", None)
    if context is not None and not context.closed:
        context.destroy(linger=0)
    gc.collect()
    cleanup_dist_env_and_memory()


def assert_same_generations(
    got: Sequence[Generation], expected: Sequence[Generation], *, atol: float = 1e-4
) -> None:
    """Same greedy tokens; each chosen token's log-probability within `atol`."""
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.tokens == e.tokens, f"prompt {i}: tokens {g.tokens} != {e.tokens}"
        worst = max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs, strict=True))
        assert worst <= atol, f"prompt {i}: log-probabilities differ by up to {worst:.3g}"


def differ(a: Sequence[Generation], b: Sequence[Generation], *, atol: float = 1e-3) -> bool:
    """Whether two sets of generations differ beyond numerical noise."""
    return any(
        x.tokens != y.tokens
        or max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) > atol
        for x, y in zip(a, b, strict=True)
    )


def vllm_greedy(
    llm: Any, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = MAX_TOKENS
) -> list[Generation]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    generations = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = tuple(int(t) for t in completion.token_ids)
        logprobs = tuple(
            float(step[token].logprob)
            for step, token in zip(completion.logprobs, tokens, strict=True)
        )
        generations.append(Generation(tokens, logprobs))
    return generations


def hf_greedy(
    model_dir: Path, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = MAX_TOKENS
) -> list[Generation]:
    """Greedy decoding with ``transformers`` (full forward per step; the models are tiny)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    generations = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            tokens: list[int] = []
            logprobs: list[float] = []
            for _ in range(max_tokens):
                logits = model(input_ids=ids).logits[0, -1].float()
                step = torch.log_softmax(logits, dim=-1)
                token = int(step.argmax())
                tokens.append(token)
                logprobs.append(float(step[token]))
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            generations.append(Generation(tuple(tokens), tuple(logprobs)))
    return generations
