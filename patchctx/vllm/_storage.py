"""Delta sync through storage on a serving engine: prepare while generating, apply in a pause.

Each worker (`StorageWorkerExtension`) prepares the chain from its weight version to the newest
published one in a background thread (`StorageFollower.prepare`: fetch, checks, decode, merge,
and the routes and loader checks of new names) while the engine keeps scheduling requests.
The driver then pauses generation with ``pause_generation(mode="keep")`` (running requests are
frozen, not aborted), has every worker apply its prepared update in one atomic call, and
resumes. `sync_server` does those steps against ``vllm serve`` over HTTP (the server runs
with ``VLLM_SERVER_DEV_MODE=1`` for ``/pause``, ``/resume`` and ``/collective_rpc``); with
`paused_apply` installed (``vllm serve --middleware patchctx.vllm.paused_apply``) the pause,
the apply and the resume are one request, run inside the server.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, cast

from patchctx import PatchError, StorageFollower, StoredUpdateError
from patchctx._model import SupportsLoadWeights
from patchctx._storage._sync import PreparedUpdate
from patchctx.vllm._apply import failure_details
from patchctx.vllm._extension import PatchWorkerExtension
from patchctx.vllm._planned import PlannedUpdate, apply_planned, plan_update

__all__ = ["PAUSED_APPLY_PATH", "StorageWorkerExtension", "paused_apply", "sync_server"]

PAUSED_APPLY_PATH = "/patchctx/paused_apply"
"""The path `paused_apply` answers (``POST``, body ``{"timeout": seconds}``)."""


class _Preparing:
    """One background prepare: its thread, and what it found."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.prepared: PreparedUpdate | None = None
        self.plan: PlannedUpdate | None = None  # its writes, when routes decide them all
        self.error: BaseException | None = None
        self.started = 0.0
        self.seconds = 0.0
        self.began_at: float | None = None  # wall clock (time.time()), for other processes
        self.ended_at: float | None = None


class StorageWorkerExtension(PatchWorkerExtension):
    """A vLLM worker extension that follows a `StoragePublisher`'s versions.

    Everything `PatchWorkerExtension` does, plus, called by name through ``collective_rpc``
    (over HTTP: ``POST /collective_rpc`` of a ``vllm serve`` in dev mode):

    - ``patchctx_storage_prepare(location, target=None)``: start preparing the chain from this
      worker's version to `target` (default: the newest published) in a background thread,
      and return at once: generation goes on meanwhile. Route learning and the loader checks
      of names not seen before happen there too, so the apply that follows replays routes.
      When routes decide every write, the prepare also finds them (storage positions, values
      cast to the weights' dtypes), so the pause only checks the written tensors and writes.
    - ``patchctx_storage_status()``: ``state`` (``idle``, ``preparing``, ``prepared``,
      ``nothing`` or ``failed``), the chain, its bytes, the prepare's seconds, its start and
      end on the wall clock (``prepare_began_at``, ``prepare_ended_at``: ``time.time()``, to
      line them up with what other processes saw), the error.
    - ``patchctx_storage_apply(timeout=60)``: wait for the prepare, then apply it in one atomic
      call (the worker's version check, tied aliases and transformed weights refused, as for
      every update; the prepared writes when every tensor they write is still the one they
      were found for, else the full call); returns the statistics of
      `PatchWorkerExtension.patchctx_apply_patches` (``planned: True`` when the prepared writes
      were made) plus ``prepare_seconds`` and ``wait_ms``. A failure is returned as ``{"ok": False,
      "error": ...}`` and nothing is applied.

    The worker's version is the one `PatchWorkerExtension` keeps (``patchctx_weight_version``);
    `None` (unknown, as after engine start) makes the first sync start at an anchor.

    Examples:
        >>> import tempfile, torch
        >>> from types import SimpleNamespace
        >>> from patchctx import StoragePublisher
        >>> from patchctx.vllm import StorageWorkerExtension
        >>> class Model(torch.nn.Module):  # stands for the worker's vLLM model
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        ...     def load_weights(self, weights):
        ...         for name, tensor in weights:
        ...             self.w.copy_(tensor)
        ...         return {"w"}
        >>> store = tempfile.mkdtemp()
        >>> _ = StoragePublisher(store).publish({"w": torch.arange(4.0)})
        >>> model, worker = Model(), StorageWorkerExtension()
        >>> worker.model_runner = SimpleNamespace(get_model=lambda: model)
        >>> worker.patchctx_storage_prepare(store)["state"]
        'preparing'
        >>> stats = worker.patchctx_storage_apply()
        >>> stats["ok"], stats["version"], model.w.tolist()
        (True, 1, [0.0, 1.0, 2.0, 3.0])
    """

    def _patchctx_preparing(self) -> _Preparing:
        found = vars(self).get("_patchctx_preparing_state")
        if found is None:
            found = _Preparing()
            self._patchctx_preparing_state = found
        assert isinstance(found, _Preparing)
        return found

    def patchctx_storage_prepare(self, location: str, target: int | None = None) -> dict[str, Any]:
        """Start preparing the chain to `target` in the background (see the class)."""
        preparing = self._patchctx_preparing()
        if preparing.thread is not None and preparing.thread.is_alive():
            return self.patchctx_storage_status()
        fresh = _Preparing()
        fresh.started = time.perf_counter()
        fresh.began_at = time.time()
        model = self._patchctx_model()
        patcher = self._patchctx_worker()
        version = patcher.version if isinstance(patcher.version, int) else None

        def work() -> None:
            try:
                follower = StorageFollower(
                    location,
                    cast(SupportsLoadWeights, model),
                    version=version,
                    routes=patcher.routes,
                )
                prepared = follower.prepare(target, learn_routes=False)
                if prepared is not None:
                    sparse = {
                        (p.name, tuple(p.shape), p.dtype)
                        for p in prepared.patches
                        if p.indices is not None
                    }
                    patcher.warm(model, sorted(sparse, key=lambda spec: spec[0]))
                    patcher.check(model, list(prepared.patches))
                    fresh.plan = plan_update(patcher, model, prepared.patches)
                fresh.prepared = prepared
            except BaseException as error:  # reported by status and apply
                fresh.error = error
            finally:
                fresh.seconds = time.perf_counter() - fresh.started
                fresh.ended_at = time.time()

        fresh.thread = threading.Thread(target=work, name="patchctx-storage-prepare", daemon=True)
        self._patchctx_preparing_state = fresh
        fresh.thread.start()
        return {"state": "preparing", "version": patcher.version}

    def patchctx_storage_status(self) -> dict[str, Any]:
        """Where the background prepare stands (see the class)."""
        preparing = self._patchctx_preparing()
        prepared = preparing.prepared
        if preparing.thread is None:
            state = "idle"
        elif preparing.thread.is_alive():
            state = "preparing"
        elif preparing.error is not None:
            state = "failed"
        else:
            state = "nothing" if prepared is None else "prepared"
        return {
            "state": state,
            "version": self._patchctx_worker().version,
            "target": None if prepared is None else prepared.target_version,
            "chain": [] if prepared is None else list(prepared.chain),
            "nbytes": 0 if prepared is None else prepared.nbytes,
            "prepare_seconds": preparing.seconds,
            "prepare_began_at": preparing.began_at,
            "prepare_ended_at": preparing.ended_at,
            "error": None if preparing.error is None else str(preparing.error),
        }

    def patchctx_storage_apply(self, timeout: float | None = 60.0) -> dict[str, Any]:
        """Apply what the background prepare found, in one atomic call (see the class)."""
        preparing = self._patchctx_preparing()
        rank = int(getattr(self, "rank", 0) or 0)
        patcher = self._patchctx_worker()
        waited = time.perf_counter()
        if preparing.thread is not None:
            preparing.thread.join(timeout)
        wait_ms = (time.perf_counter() - waited) * 1e3
        try:
            if preparing.thread is None:
                raise StoredUpdateError("patchctx_storage_apply: nothing was prepared")
            if preparing.thread.is_alive():
                raise StoredUpdateError(f"the prepare is still running after {timeout} s")
            if preparing.error is not None:
                if isinstance(preparing.error, PatchError):
                    raise preparing.error
                raise StoredUpdateError(f"the prepare failed: {preparing.error!r}")
            prepared = preparing.prepared
            if prepared is None:  # nothing newer than what the worker holds
                return {
                    "rank": rank,
                    "ok": True,
                    "names": [],
                    "version": patcher.version,
                    "prepare_seconds": preparing.seconds,
                    "wait_ms": wait_ms,
                }
            if prepared.base_version is not None and prepared.base_version != patcher.version:
                raise StoredUpdateError(
                    f"the prepared update goes from version {prepared.base_version} to "
                    f"{prepared.target_version}; this worker holds {patcher.version!r} "
                    "(stale base); nothing was written"
                )
            model = self._patchctx_model()
            stats = None
            if preparing.plan is not None:  # the writes found in the prepare, if still live
                stats = apply_planned(
                    patcher,
                    model,
                    preparing.plan,
                    base_version=prepared.base_version,
                    target_version=prepared.target_version,
                )
            if stats is None:
                stats = patcher.apply(
                    model,
                    list(prepared.patches),
                    base_version=prepared.base_version,
                    target_version=prepared.target_version,
                    atomic=True,
                )
        except PatchError as error:
            details = failure_details(error, rank)
            return {"rank": rank, "ok": False, "error": details, "version": patcher.version}
        finally:
            self._patchctx_preparing_state = _Preparing()
        return {
            "rank": rank,
            **stats,
            "chain": list(prepared.chain),
            "prepare_seconds": preparing.seconds,
            "wait_ms": wait_ms,
        }


async def paused_apply(request: Any, call_next: Any) -> Any:
    """A ``vllm serve`` middleware: pause, apply the workers' prepared updates, resume, in one.

    Start the server with ``--middleware patchctx.vllm.paused_apply``. A ``POST`` to
    `PAUSED_APPLY_PATH` then runs, inside the server, ``pause_generation(mode="keep")``,
    ``patchctx_storage_apply`` on every worker (``collective_rpc``) as soon as the engine is
    paused, and ``resume_generation`` once both have returned (also when the apply failed or
    raised), and answers ``{"results":
    [each worker's statistics], "window_ms": ms from the pause to the resume's end}``; the
    driver's pause and resume requests and their round trips are gone from the paused
    window. It applies only what the workers prepared (``patchctx_storage_prepare``, through
    ``/collective_rpc``, in dev mode). Every other request passes through. `sync_server` uses
    it when the server has it.

    Examples:
        >>> from patchctx.vllm import PAUSED_APPLY_PATH, paused_apply
        >>> PAUSED_APPLY_PATH, paused_apply.__name__  # a live server: see the vLLM page
        ('/patchctx/paused_apply', 'paused_apply')
    """
    if request.url.path != PAUSED_APPLY_PATH or request.method != "POST":
        return await call_next(request)
    # The server's web framework (a dependency of vLLM's server, not of patchctx).
    json_response: Any = importlib.import_module("starlette.responses").JSONResponse
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
        timeout = float(body.get("timeout", 60.0)) if isinstance(body, dict) else 60.0
    except (ValueError, TypeError) as error:
        return json_response({"error": f"a bad request body: {error}"}, status_code=400)
    engine = request.app.state.engine_client
    began = time.perf_counter()
    pausing = asyncio.ensure_future(engine.pause_generation(mode="keep"))
    failure: str | None = None
    try:
        # The apply starts once the engine says it is paused: steps are no longer scheduled,
        # and each worker runs the apply after any step already sent to it. It overlaps the
        # short wait pause_generation makes for the outputs on their way (20 ms in vLLM
        # 0.32); the resume waits for the pause to have returned.
        while not await engine.is_paused():
            if pausing.done():
                pausing.result()  # the pause raised: answered below
                break
        results = await engine.collective_rpc("patchctx_storage_apply", args=(timeout,))
    except Exception as error:  # answered, after the resume below
        failure = f"{type(error).__name__}: {error}"
    finally:
        try:
            await pausing
        except Exception as error:
            failure = failure or f"{type(error).__name__}: {error}"
        await engine.resume_generation()
    window_ms = (time.perf_counter() - began) * 1e3
    if failure is not None:
        return json_response({"error": failure, "window_ms": window_ms}, status_code=500)
    return json_response({"results": list(results), "window_ms": window_ms})


def _post(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data if data is not None else b"", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as error:
        message = f"{url}: HTTP {error.code}: {error.read().decode()[:400]}"
        raise _HTTPError(error.code, message) from None
    return json.loads(text) if text else None


class _HTTPError(StoredUpdateError):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# Servers seen without `paused_apply` (answered 404): the driver pauses and resumes itself.
_WITHOUT_PAUSED_APPLY: set[str] = set()


def _rpc(base: str, method: str, *args: Any, timeout: float = 120.0) -> list[Any]:
    answer = _post(f"{base}/collective_rpc", {"method": method, "args": list(args)}, timeout)
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        raise StoredUpdateError(
            f"{base}/collective_rpc {method}: unexpected answer {answer!r:.200}"
        )
    return results


def sync_server(
    url: str,
    location: str,
    *,
    target: int | None = None,
    poll_seconds: float = 0.01,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """Bring a ``vllm serve`` (started with `StorageWorkerExtension`) to the newest version.

    1. ``patchctx_storage_prepare`` on every worker; generation goes on while they prepare
       (polled with ``patchctx_storage_status``);
    2. ``POST /pause?mode=keep``: running requests are frozen, not aborted;
    3. ``patchctx_storage_apply`` on every worker (one atomic call each);
    4. ``POST /resume``, also when the apply failed.

    Steps 2 to 4 are one request when the server runs `paused_apply` (else three).

    Args:
        url: The server's base URL (``http://127.0.0.1:8000``).
        location: The publisher's directory or fsspec URL, as the workers see it.
        target: The version to reach (default: the newest published).
        poll_seconds: How often to ask whether the workers have prepared.
        timeout: Seconds for the prepare, and for each request.

    Returns:
        ``prepare_seconds`` (the background time, as the driver saw it), ``pause_seconds``
        (from the pause request to the resume's answer), ``server_window_ms`` (from the pause
        to the resume inside the server, with `paused_apply`; else `None`), ``apply_ms`` (the
        slowest worker's apply), ``version`` and ``workers`` (each worker's statistics).

    Raises:
        StoredUpdateError: A worker refused the update (nothing was applied on it) or the
            server answered with an error.

    Examples:
        >>> from patchctx.vllm import sync_server
        >>> sync_server.__name__  # against a live server: see the vLLM integration page
        'sync_server'
    """
    base = url.rstrip("/")
    started = time.perf_counter()
    _rpc(base, "patchctx_storage_prepare", location, target, timeout=timeout)
    while True:
        states = _rpc(base, "patchctx_storage_status", timeout=timeout)
        if all(state["state"] != "preparing" for state in states):
            break
        if time.perf_counter() - started > timeout:
            raise StoredUpdateError(f"{base}: the workers did not prepare in {timeout} s")
        time.sleep(poll_seconds)
    prepared = time.perf_counter()
    workers, server_window_ms = _paused_apply(base, timeout)
    resumed = time.perf_counter()
    failed = [w for w in workers if not w.get("ok", True)]
    if failed:
        raise StoredUpdateError(f"{base}: the update was refused: {failed[0]['error']}")
    return {
        "prepare_seconds": prepared - started,
        "pause_seconds": resumed - prepared,
        "server_window_ms": server_window_ms,
        "apply_ms": max(float(w.get("milliseconds", 0.0)) for w in workers),
        "version": workers[0].get("version"),
        "workers": workers,
    }


def _paused_apply(base: str, timeout: float) -> tuple[list[Any], float | None]:
    """Pause, apply on every worker, resume: in one request if the server can, else three."""
    if base not in _WITHOUT_PAUSED_APPLY:
        try:
            answer = _post(f"{base}{PAUSED_APPLY_PATH}", {"timeout": timeout}, timeout)
        except _HTTPError as error:
            if error.code != 404:
                raise
            _WITHOUT_PAUSED_APPLY.add(base)  # nothing was paused: the path is not served
        else:
            results = answer.get("results") if isinstance(answer, dict) else None
            if not isinstance(results, list):
                raise StoredUpdateError(
                    f"{base}{PAUSED_APPLY_PATH}: unexpected answer {answer!r:.200}"
                )
            return results, float(answer["window_ms"])
    _post(f"{base}/pause?mode=keep", None, timeout)
    try:
        workers = _rpc(base, "patchctx_storage_apply", timeout, timeout=timeout)
    finally:
        _post(f"{base}/resume", None, timeout)
    return workers, None
