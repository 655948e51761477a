"""Tied embeddings: which checkpoint names are aliases of another, read from the live model."""

from __future__ import annotations

import torch

from patchctx.vllm._walk import ModelWalk

__all__ = ["aliases_in", "tied_aliases"]


def _embedding_classes() -> tuple[type[torch.nn.Module], ...]:
    classes: list[type[torch.nn.Module]] = [torch.nn.Embedding]
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            VocabParallelEmbedding,  # ParallelLMHead derives from it
        )
    except ImportError:  # pragma: no cover - vLLM moved it; plain embeddings still count
        pass
    else:
        classes.append(VocabParallelEmbedding)
    return tuple(classes)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Map every alias of a tied embedding parameter to its canonical name.

    An embedding parameter reached under several names (a tied ``lm_head.weight`` is
    ``model.embed_tokens.weight``) is loaded under its first name in module order; the other
    names are aliases. vLLM's loader skips an alias and, since 0.32, raises unless the
    canonical name arrives in the same ``load_weights`` call, so a patch named after the
    LM head of a tied model must be loaded under the embedding's name: pass this map as
    ``aliases=`` to `load_checkpoint_weight_patches` (the worker extension does).

    The map is read from parameter identity on the live model, as vLLM does, not from the
    model config: a checkpoint that declares untied embeddings but stores equal tensors may
    be re-tied by vLLM after loading.

    Args:
        model: The model (a vLLM model, or any ``torch.nn.Module``). Parameters of
            ``torch.nn.Embedding`` and vLLM's ``VocabParallelEmbedding`` (``ParallelLMHead``
            included) are considered.

    Returns:
        Alias name -> canonical name; empty when nothing is tied.

    Examples:
        >>> import torch
        >>> from patchctx.vllm import tied_aliases
        >>> class Tiny(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed_tokens = torch.nn.Embedding(8, 2)
        ...         self.lm_head = self.embed_tokens  # tied
        >>> tied_aliases(Tiny())
        {'lm_head.weight': 'embed_tokens.weight'}
    """
    return aliases_in(ModelWalk.of(model))


def aliases_in(walk: ModelWalk) -> dict[str, str]:
    """`tied_aliases` of the model `walk` lists (read from it now, not cached)."""
    classes = _embedding_classes()
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for prefix, module in walk.modules:
        if not isinstance(module, classes):
            continue
        for local, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            first = canonical.setdefault(id(param), name)
            if first != name:
                aliases[name] = first
    return aliases
