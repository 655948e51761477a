"""Rank jobs for `RouteCache.warm` on vLLM's real layers and models (see ``test_warm.py``).

Each job warms a cache on a loaded model, checks that no weight changed, compares every learnt
route with the one a real sparse patch records, and applies a round of sparse patches along
the learnt routes against the dense truth (the model loaded from the patched checkpoint).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from patchctx import RouteCache, load_checkpoint_weight_patches
from patchctx.vllm._apply import WorkerPatcher
from tests.vllm.support.checkpoints import (
    build_model,
    checkpoint_aliases,
    load_engine_model,
    load_model,
    model_state,
    read_checkpoint,
    specs_of,
    unchanged,
)
from tests.vllm.support.dist import Rank, Results
from tests.vllm.support.layers import CASES
from tests.vllm.support.patches import (
    ModelWorker,
    apply_to_checkpoint,
    patchctx_load,
    random_checkpoint,
    sparse,
)


def _same_geometry(a: Any, b: Any) -> bool:
    """Two routes with the same segments, storage pointers aside (models built twice)."""
    if a is None or b is None:
        return a is b
    return (a.name, a.shape, a.dtype, a.reported) == (b.name, b.shape, b.dtype, b.reported) and [
        (s.source, s.target, s.tensor_name, s.dtype, s.layout) for s in a.segments
    ] == [(s.source, s.target, s.tensor_name, s.dtype, s.layout) for s in b.segments]


def warm_layer_job(rank: Rank, args: Mapping[str, Any]) -> Results:
    """Per case and dtype: ``"<case>/<dtype>/warm"`` = (names, learned, weights unchanged,
    learnt routes equal to recorded ones, patches replayed, loader calls, verify clean) and
    ``"<case>/<dtype>/equal"`` = the patched layer equals the dense truth."""
    results: Results = {}
    for dtype_name in args["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for n, case in enumerate(CASES.values()):
            shapes = {t.name: t.shape for t in case.tensors}
            specs = [(t.name, t.shape, torch.float32) for t in case.tensors]
            checkpoint = random_checkpoint(shapes, seed=n)
            patches = [
                sparse(t.name, t.shape, density=0.05, seed=100 * n + i)
                for i, t in enumerate(case.tensors)
            ]
            truth, warmed, recorded = (case.harness(dtype) for _ in range(3))
            truth.load_weights(apply_to_checkpoint(checkpoint, patches).items())
            warmed.load_weights(checkpoint.items())
            recorded.load_weights(checkpoint.items())
            before = warmed.state()
            routes = RouteCache()
            report = routes.warm(warmed, specs)
            same = all(torch.equal(before[k], v) for k, v in warmed.state().items())
            clean = routes.verify(warmed) == []
            calls_before = routes.stats.loader_calls
            reference = RouteCache()
            load_checkpoint_weight_patches(recorded, patches, routes=reference)
            agree = all(
                _same_geometry(routes._route(t.name), reference._route(t.name))
                for t in case.tensors
            )
            load_checkpoint_weight_patches(warmed, patches, routes=routes)
            results[f"{case.name}/{dtype_name}/warm"] = torch.tensor(
                [
                    len(case.tensors),
                    report.counts()["learned"],
                    same,
                    agree,
                    routes.stats.replayed,
                    routes.stats.loader_calls - calls_before,
                    clean,
                ]
            )
            results[f"{case.name}/{dtype_name}/equal"] = torch.tensor(
                all(torch.equal(truth.state()[k], v) for k, v in warmed.state().items())
            )
    return results


def warm_model_job(rank: Rank, args: Mapping[str, Any]) -> Results:
    """Per architecture, as the worker extension holds the model (checkpoint layout):
    ``"<arch>/warm"`` = (names, learned, unchanged, routes equal to recorded ones, replayed,
    loader calls of the first update, audits skipped), ``"<arch>/equal"`` = the first update
    gives the dense truth; and on the default CPU engine's layout ``"<arch>/engine"`` =
    (names, learned, unlearnable, unchanged)."""
    results: Results = {}
    for arch, directory in args["model_dirs"].items():
        model_dir = Path(directory)
        checkpoint = read_checkpoint(model_dir)
        aliases = checkpoint_aliases(checkpoint)
        specs = specs_of(checkpoint)
        patches = [
            sparse(name, shape, density=0.02, seed=i)
            for i, (name, shape, _) in enumerate(specs)
            if aliases.get(name, name) == name
        ]
        truth: Any = build_model(model_dir, rank.world_size)
        truth.load_weights(apply_to_checkpoint(checkpoint, patches, aliases).items())
        model = load_model(model_dir, rank.world_size)
        before = model_state(model)
        worker = ModelWorker(model)
        patcher: WorkerPatcher = worker._patchctx_worker()
        report = patcher.warm(model, specs)
        same = unchanged(before, model)
        reference = RouteCache()
        recorded: Any = load_model(model_dir, rank.world_size)
        load_checkpoint_weight_patches(recorded, patches, routes=reference)
        agree = all(
            _same_geometry(patcher.routes._route(row.name), reference._route(row.name))
            for row in report.rows
            if row.status == "learned"
        )
        consumed = len(patcher.consumed)
        stats = patchctx_load(worker, patches)
        results[f"{arch}/warm"] = torch.tensor(
            [
                len(report.rows),
                report.counts()["learned"],
                same,
                agree,
                stats["replayed"],
                stats["loader_calls"],
                consumed,
            ]
        )
        results[f"{arch}/equal"] = torch.tensor(
            all(torch.equal(v, model_state(truth)[k]) for k, v in model_state(model).items())
        )
        engine = load_engine_model(model_dir, rank.world_size)
        before = model_state(engine)
        engine_report = WorkerPatcher().warm(engine, specs)
        counts = engine_report.counts()
        results[f"{arch}/engine"] = torch.tensor(
            [
                len(engine_report.rows),
                counts["learned"],
                counts["unlearnable"],
                unchanged(before, engine),
            ]
        )
    return results
