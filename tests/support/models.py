"""Small models whose ``load_weights`` map checkpoint tensors the way vLLM's layers do.

Every layer takes full checkpoint tensors (Hugging Face names and shapes) and writes the part it
owns into its parameters: tensor-parallel slices, packed Q/K/V and gate/up parameters, replicated
KV heads, transposed storage, dtype casts, vocabulary padding. `ToyModel.load_weights` returns
the names of the parameters it wrote, as vLLM's models do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Spec:
    """A checkpoint tensor: full shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class ToyLayer(nn.Module):
    """A layer that owns some checkpoint tensors (``specs``) and loads them (``load``)."""

    specs: dict[str, Spec]
    weight: nn.Parameter

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        raise NotImplementedError


class QKVLinear(ToyLayer):
    """Like vLLM's QKVParallelLinear at one tensor-parallel rank.

    Checkpoint: ``q_proj`` [heads*hd, hidden], ``k_proj``/``v_proj`` [kv_heads*hd, hidden].
    Parameter: [(q_local + 2*kv_local)*hd, hidden]. With fewer KV heads than ranks, each KV
    head is replicated over several ranks (``rank // replicas`` picks the head).
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        assert heads % tp_size == 0
        self.hidden, self.head_dim, self.tp_rank = hidden, head_dim, tp_rank
        self.q_local = heads // tp_size * head_dim
        if kv_heads >= tp_size:
            assert kv_heads % tp_size == 0
            self.kv_local = kv_heads // tp_size * head_dim
            self.kv_shard = tp_rank
        else:
            assert tp_size % kv_heads == 0
            self.kv_local = head_dim
            self.kv_shard = tp_rank // (tp_size // kv_heads)
        rows = self.q_local + 2 * self.kv_local
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype), requires_grad=False)
        self.specs = {
            "q_proj": Spec((heads * head_dim, hidden), dtype),
            "k_proj": Spec((kv_heads * head_dim, hidden), dtype),
            "v_proj": Spec((kv_heads * head_dim, hidden), dtype),
        }

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        if shard == "q_proj":
            offset, size, index = 0, self.q_local, self.tp_rank
        elif shard == "k_proj":
            offset, size, index = self.q_local, self.kv_local, self.kv_shard
        else:
            offset, size, index = self.q_local + self.kv_local, self.kv_local, self.kv_shard
        source = loaded.narrow(0, index * size, size)
        self.weight.data.narrow(0, offset, size).copy_(source)


class GateUpLinear(ToyLayer):
    """Like MergedColumnParallelLinear: gate and up packed, each sliced along dim 0."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.local, self.tp_rank = inter // tp_size, tp_rank
        self.weight = nn.Parameter(
            torch.zeros(2 * self.local, hidden, dtype=dtype), requires_grad=False
        )
        self.specs = {
            "gate_proj": Spec((inter, hidden), dtype),
            "up_proj": Spec((inter, hidden), dtype),
        }

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        offset = 0 if shard == "gate_proj" else self.local
        source = loaded.narrow(0, self.tp_rank * self.local, self.local)
        self.weight.data[offset : offset + self.local].copy_(source)


class RowLinear(ToyLayer):
    """Like RowParallelLinear: the input dimension (dim 1) is sliced; a strided source view."""

    def __init__(
        self,
        inter: int,
        hidden: int,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.local, self.tp_rank = inter // tp_size, tp_rank
        self.weight = nn.Parameter(
            torch.zeros(hidden, self.local, dtype=dtype), requires_grad=False
        )
        self.specs = {"down_proj": Spec((hidden, inter), dtype)}

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        self.weight.data.copy_(loaded.narrow(1, self.tp_rank * self.local, self.local))


class TransposedLinear(ToyLayer):
    """Stores the weight transposed ([in, out]) and copies a transposed view of the checkpoint."""

    def __init__(self, rows: int, cols: int, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cols, rows, dtype=dtype), requires_grad=False)
        self.specs = {"proj": Spec((rows, cols), dtype)}

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        self.weight.data.copy_(loaded.t())


class ContiguousLinear(ToyLayer):
    """Materialises a transposed copy (``.contiguous()``) before its final copy_."""

    def __init__(self, rows: int, cols: int, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cols, rows, dtype=dtype), requires_grad=False)
        self.specs = {"proj": Spec((rows, cols), dtype)}

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        self.weight.data.copy_(loaded.t().contiguous())


class CastLinear(ToyLayer):
    """Runtime dtype differs from the checkpoint's: the cast happens inside copy_."""

    def __init__(
        self,
        rows: int,
        cols: int,
        *,
        checkpoint_dtype: torch.dtype = torch.float32,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols, dtype=dtype), requires_grad=False)
        self.specs = {"proj": Spec((rows, cols), checkpoint_dtype)}

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        self.weight.data.copy_(loaded)


class PaddedEmbedding(ToyLayer):
    """Like VocabParallelEmbedding at TP=1: rows beyond the vocabulary are zero-filled padding."""

    def __init__(
        self, vocab: int, hidden: int, *, pad_to: int = 8, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        padded = -(-vocab // pad_to) * pad_to
        self.vocab = vocab
        self.weight = nn.Parameter(torch.zeros(padded, hidden, dtype=dtype), requires_grad=False)
        self.specs = {"embed": Spec((vocab, hidden), dtype)}

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        self.weight[: loaded.shape[0]].data.copy_(loaded)
        self.weight[loaded.shape[0] :].data.fill_(0)


class IntLinear(ToyLayer):
    """An int8 quantized weight with a float32 per-row scale, both loaded by copy_."""

    def __init__(self, rows: int, cols: int, *, dtype: torch.dtype = torch.int8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols, dtype=dtype), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(rows), requires_grad=False)
        self.specs = {"qweight": Spec((rows, cols), dtype), "scale": Spec((rows,), torch.float32)}

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        target = self.weight if shard == "qweight" else self.scale
        target.data.copy_(loaded)


class PlainLayer(ToyLayer):
    """Tensors of any shape (0-d and empty included) and dtype, each loaded by a plain copy_."""

    def __init__(self, specs: Mapping[str, Spec]) -> None:
        super().__init__()
        self.specs = dict(specs)
        self.tensors = nn.ParameterDict(
            {
                shard: nn.Parameter(torch.zeros(spec.shape, dtype=spec.dtype), requires_grad=False)
                for shard, spec in specs.items()
            }
        )

    def load(self, shard: str, loaded: torch.Tensor) -> None:
        self.tensors[shard].data.copy_(loaded)


def mixed_dtype_model() -> ToyModel:
    """Scalars, empty tensors, int8 with a float scale, wide unsigned ints, bool, float8 and
    complex weights."""
    return ToyModel(
        {
            "plain": PlainLayer(
                {
                    "scalar": Spec((), torch.float32),
                    "empty": Spec((0, 3), torch.bfloat16),
                    "vector": Spec((7,), torch.float16),
                    "matrix": Spec((5, 6), torch.bfloat16),
                    "wide": Spec((3, 4), torch.float64),
                    "counts": Spec((4, 5), torch.int32),
                    "packed": Spec((3, 3), torch.uint16),
                    "codes": Spec((6,), torch.uint32),
                    "flags": Spec((9,), torch.bool),
                    "e4m3": Spec((4, 4), torch.float8_e4m3fn),
                    "e5m2": Spec((8,), torch.float8_e5m2),
                    "complex": Spec((2, 3), torch.complex64),
                    "complex128": Spec((5,), torch.complex128),
                }
            ),
            "quant": IntLinear(4, 6),
        }
    )


class ToyModel(nn.Module):
    """A model of named layers; checkpoint names are ``"<layer>.<shard>.weight"``."""

    def __init__(self, layers: Mapping[str, ToyLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(dict(layers))
        self.load_calls: list[list[str]] = []

    def layer(self, name: str) -> ToyLayer:
        layer = self.layers[name]
        assert isinstance(layer, ToyLayer)
        return layer

    def checkpoint_specs(self) -> dict[str, Spec]:
        specs: dict[str, Spec] = {}
        for layer_name in self.layers:
            for shard, spec in self.layer(layer_name).specs.items():
                specs[f"{layer_name}.{shard}.weight"] = spec
        return specs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        names = []
        for name, tensor in weights:
            names.append(name)
            layer_name, shard, _ = name.split(".")
            layer = self.layer(layer_name)
            layer.load(shard, tensor)
            loaded.update(f"layers.{layer_name}.{p}" for p, _ in layer.named_parameters())
        self.load_calls.append(names)
        return loaded


def packed_tp_model(
    *,
    hidden: int = 16,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 4,
    inter: int = 32,
    tp_size: int = 2,
    tp_rank: int = 0,
    dtype: torch.dtype = torch.float32,
) -> ToyModel:
    """A decoder-layer-shaped model at one tensor-parallel rank: packed QKV, packed gate/up,
    row-parallel down projection, a transposed and a cast projection, a padded embedding."""
    cast_dtype = torch.bfloat16 if dtype == torch.float32 else torch.float32
    return ToyModel(
        {
            "qkv": QKVLinear(
                hidden, heads, kv_heads, head_dim, tp_size=tp_size, tp_rank=tp_rank, dtype=dtype
            ),
            "mlp": GateUpLinear(hidden, inter, tp_size=tp_size, tp_rank=tp_rank, dtype=dtype),
            "down": RowLinear(inter, hidden, tp_size=tp_size, tp_rank=tp_rank, dtype=dtype),
            "tr": TransposedLinear(hidden, 8, dtype=dtype),
            "cast": CastLinear(6, hidden, checkpoint_dtype=dtype, dtype=cast_dtype),
            "emb": PaddedEmbedding(13, hidden, dtype=dtype),
        }
    )


def random_checkpoint(
    specs: Mapping[str, Spec], *, seed: int = 0, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Full checkpoint tensors with random contents (integers over their whole range)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, spec in specs.items():
        tensors[name] = random_tensor(spec.shape, spec.dtype, generator).to(device)
    return tensors


def loaded(model: ToyModel, seed: int = 0) -> dict[str, torch.Tensor]:
    """Load a random full checkpoint into `model`; return it (and forget the loader calls)."""
    checkpoint = random_checkpoint(model.checkpoint_specs(), seed=seed)
    model.load_weights(checkpoint.items())
    model.load_calls.clear()
    return checkpoint


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(shape, generator=generator, dtype=torch.float64)
        if dtype.is_complex:
            imag = torch.randn(shape, generator=generator, dtype=torch.float64)
            return torch.complex(base, imag).to(dtype)
        return base.to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high + 1, shape, generator=generator, dtype=torch.int64).to(dtype)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer, for bit-for-bit comparison."""
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, so that comparisons are exact (NaN payloads and -0.0 included)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype.is_complex:
        tensor = torch.view_as_real(tensor).contiguous()
    size = tensor.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return tensor.view(as_int) if tensor.dtype != torch.bool else tensor.to(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def assert_same_state(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> None:
    assert actual.keys() == expected.keys()
    different = [name for name in actual if not same_bits(actual[name], expected[name])]
    assert not different, f"tensors differ bit for bit: {different}"
