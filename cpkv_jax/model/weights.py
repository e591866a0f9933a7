"""Checkpoint I/O: Hugging Face safetensors in and out, and orbax state snapshots.

HF names map one to one onto `CausalLM` parameter paths (`model.layers.3.mlp.gate.weight`
is the leaf at `("model", "layers", 3, "mlp", "gate", "weight")`), except the routed
experts: HF stores `mlp.experts.{e}.{gate,up,down}_proj.weight` per expert, we stack them
into one `[E, out, in]` leaf `mlp.experts.{gate,up,down}_proj`.

Loading (`load_hf_weights`) reads the checkpoint's headers first and validates everything
(missing tensors, shapes, FP8 scale pairs) before reading any data, then reads tensor by
tensor. Tensors the model does not expect are handled as:
- `model.layers.{i}.*` with `i >= num_hidden_layers` (MTP / next-token-prediction
  layers): loaded into the MTP layer when the model has one (`mtp=True`; its copies of
  the embedding and the LM head are not: the trunk's are used), else skipped, one INFO
  line;
- known harmless extras (`*.rotary_emb.inv_freq`, `lm_head.weight` of a tied model):
  skipped, DEBUG line;
- anything else: a WARNING naming them (the load still succeeds, since every expected
  tensor was found with the right shape), or a `CheckpointError` with `strict=True`.
  A renamed tensor cannot slip through either way: its expected name is then missing,
  which is always an error.

Official FP8 checkpoints store block-quantized 2-D weights as `float8_e4m3fn` plus
`<name>_scale_inv` of shape `[ceil(out / B0), ceil(in / B1)]` (`cfg.weight_block_size`,
default 128x128); they are dequantized at load, in float32, then cast to the leaf dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
import struct
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh
from jax.typing import DTypeLike
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import CheckpointError
from cpkv_jax.model import expert_parallel
from cpkv_jax.model.fp8 import DEFAULT_BLOCK, SCALE_SUFFIX, dequantize_np, quantize_np
from cpkv_jax.model.layers import Linear
from cpkv_jax.model.moe import EXPERT_PROJS, RoutedExperts
from cpkv_jax.model.transformer import CausalLM

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_WEIGHT_BLOCK = DEFAULT_BLOCK
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# How many names an error message lists before "... and N more".
_LIST_LIMIT = 8

# safetensors dtype tags -> numpy dtypes (ml_dtypes supplies bf16 / fp8).
_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_FP8_TAGS = ("F8_E4M3", "F8_E5M2")
_FP8_DTYPES = (_ST_DTYPES["F8_E4M3"], _ST_DTYPES["F8_E5M2"])


# ---- name layout ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one HF tensor lives in the model state."""

    path: tuple[str | int, ...]  # nnx state path of the leaf
    expert: int | None  # index into a stacked `[E, out, in]` expert leaf, else None
    shape: tuple[int, ...]  # the HF tensor's shape
    dtype: np.dtype  # the leaf's dtype (what the tensor is cast to)


def _natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders `layers.10` after `layers.9`."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _expert_hf_suffix(path: tuple[str | int, ...], ndim: int) -> str | None:
    """`gate_proj.weight` (or `.weight_scale_inv`) for a stacked expert leaf, else None."""
    if len(path) < 2 or path[-2] != "experts" or ndim != 3:
        return None
    leaf = str(path[-1])
    if leaf in EXPERT_PROJS:
        return f"{leaf}.weight"
    if leaf.endswith(SCALE_SUFFIX) and leaf[: -len(SCALE_SUFFIX)] in EXPERT_PROJS:
        return f"{leaf[: -len(SCALE_SUFFIX)]}.weight{SCALE_SUFFIX}"
    return None


def _layout(state: nnx.State) -> dict[str, _Slot]:
    """HF tensor name -> slot, for every Param leaf of `state` (abstract or concrete)."""
    slots: dict[str, _Slot] = {}
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Param):
            raise CheckpointError(
                f"model state {'.'.join(map(str, path))} is a {type(var).__name__}, not a "
                "Param: the HF loader only knows parameters; extend weights._layout"
            )
        shape, dtype = tuple(var.shape), np.dtype(var.dtype)
        name = ".".join(str(p) for p in path)
        suffix = _expert_hf_suffix(path, len(shape))
        if suffix is not None:
            prefix = ".".join(str(p) for p in path[:-1])
            for e in range(shape[0]):
                slots[f"{prefix}.{e}.{suffix}"] = _Slot(path, e, shape[1:], dtype)
        else:
            slots[name] = _Slot(path, None, shape, dtype)
    return dict(sorted(slots.items(), key=lambda kv: _natural_key(kv[0])))


@contextlib.contextmanager
def fast_tracer_probes() -> Iterator[None]:
    """Trace without building the messages of the AttributeErrors that
    `getattr(tracer, "sharding", None)` probes swallow.

    flax NNX's `Variable.set_value` probes `value.sharding` at every assignment (the
    `Rngs` counter's, once per parameter init); on a tracer, JAX 0.10.2 builds that
    error's message by walking every equation traced so far (`_origin_msg`), so tracing a
    whole model in one `eval_shape` is quadratic: ~50 s per real-dims model here, ~4 s
    without the message (jax-ml/jax#40041 proposes dropping that part upstream).
    Only the text of errors nobody reads changes; shapes, dtypes and bytes are the same
    (the tests build the tiny model both ways). A no-op if JAX's internals moved.
    """
    try:
        from jax._src.interpreters import partial_eval as pe

        cls = pe.DynamicJaxprTracer
        original = cls.__dict__["_origin_msg"]
    except (ImportError, AttributeError, KeyError):
        yield
        return
    cls._origin_msg = lambda self: ""
    try:
        yield
    finally:
        cls._origin_msg = original


def _abstract_model(
    cfg: ModelConfig, dtype: DTypeLike, param_dtype: DTypeLike, mtp: bool = False
) -> CausalLM:
    with fast_tracer_probes():
        return nnx.eval_shape(
            lambda: CausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype, mtp=mtp)
        )


def hf_tensor_names(cfg: ModelConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name `CausalLM(cfg, mtp=mtp)` expects, with its shape (natural
    name order)."""
    state = nnx.state(_abstract_model(cfg, jnp.float32, jnp.float32, mtp))
    return {name: slot.shape for name, slot in _layout(state).items()}


def hf_state_dict(model: CausalLM) -> dict[str, np.ndarray]:
    """The model's parameters as HF-named host arrays (experts unstacked), leaf dtypes kept."""
    state = nnx.state(model, nnx.Param)
    # One device -> host copy per leaf; experts are then views into their stacked copy.
    host = {
        path: np.asarray(jax.device_get(var.get_value())) for path, var in nnx.to_flat_state(state)
    }
    return {
        name: host[slot.path] if slot.expert is None else host[slot.path][slot.expert]
        for name, slot in _layout(state).items()
    }


# ---- reading safetensors -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    """One tensor as its file's header describes it."""

    file: Path
    tag: str  # safetensors dtype tag, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in the file
    end: int


def _read_header(path: Path) -> dict[str, _TensorInfo]:
    """Parse a safetensors header (8-byte little-endian length, then JSON)."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
    infos: dict[str, _TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            infos[name] = _TensorInfo(
                path, meta["dtype"], tuple(meta["shape"]), 8 + n + begin, 8 + n + end
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name}: {e}") from e
    return infos


def _checkpoint_files(model_path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint dir (checked to exist) and the index's
    tensor -> file map (None for a single `model.safetensors`)."""
    if not model_path.is_dir():
        raise CheckpointError(f"checkpoint directory {model_path} does not exist")
    index = model_path / INDEX_FILE
    if index.is_file():
        try:
            raw = json.loads(index.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index} is not valid JSON: {e}") from e
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"{index} has no 'weight_map' object of tensor name -> file name; "
                "re-export the checkpoint or remove the index to use model.safetensors"
            )
        files = sorted(set(weight_map.values()), key=_natural_key)
        missing = [f for f in files if not (model_path / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names {len(missing)} missing shard file(s) in {model_path}: "
                f"{_first(missing)}"
            )
        return [model_path / f for f in files], weight_map
    single = model_path / SINGLE_FILE
    if single.is_file():
        return [single], None
    raise CheckpointError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {model_path}: point at a HF safetensors checkpoint"
    )


def _checkpoint_tensors(model_path: Path) -> dict[str, _TensorInfo]:
    """Every tensor in the checkpoint, from the file headers (no data read)."""
    files, weight_map = _checkpoint_files(model_path)
    tensors: dict[str, _TensorInfo] = {}
    for path in files:
        for name, info in _read_header(path).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} is in both {tensors[name].file} and {path}")
            tensors[name] = info
    for name, file in (weight_map or {}).items():
        if name not in tensors or tensors[name].file.name != file:
            raise CheckpointError(
                f"{model_path / INDEX_FILE} places tensor {name} in {file}, but that file lacks it"
            )
    return tensors


class _Reader:
    """Reads tensors from open safetensors files, through `safe_open` where it can.

    `safe_open(framework="numpy")` cannot return fp8 (and, in some versions, bf16), so
    those are read raw at the header's byte offsets and viewed with the ml_dtypes dtype.
    """

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._handles: dict[Path, Any] = {}

    def read(self, name: str, info: _TensorInfo) -> np.ndarray:
        if info.tag not in _FP8_TAGS:
            try:
                return np.asarray(self._handle(info.file).get_tensor(name))
            except (AttributeError, TypeError, ValueError, SafetensorError):
                logger.debug("safe_open cannot return %s (%s); reading it raw", name, info.tag)
        return self._read_raw(name, info)

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = self._stack.enter_context(safe_open(str(path), "numpy"))
            except (OSError, SafetensorError) as e:
                raise CheckpointError(f"cannot open {path}: {e}") from e
        return self._handles[path]

    @staticmethod
    def _read_raw(name: str, info: _TensorInfo) -> np.ndarray:
        dtype = _ST_DTYPES.get(info.tag)
        if dtype is None:
            raise CheckpointError(f"tensor {name} in {info.file} has unsupported dtype {info.tag}")
        count = math.prod(info.shape)
        if info.end - info.begin != count * dtype.itemsize:
            raise CheckpointError(
                f"tensor {name} in {info.file}: header says {info.end - info.begin} bytes for "
                f"shape {info.shape} {info.tag}; the file is corrupt"
            )
        with info.file.open("rb") as f:
            f.seek(info.begin)
            data = f.read(info.end - info.begin)
        if len(data) != count * dtype.itemsize:
            raise CheckpointError(f"tensor {name}: {info.file} is truncated")
        return np.frombuffer(data, dtype=dtype).reshape(info.shape)


def _first(names: list[str]) -> str:
    more = f" ... and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return ", ".join(names[:_LIST_LIMIT]) + more


@dataclasses.dataclass
class _Plan:
    """What to do with each checkpoint tensor, decided from headers alone."""

    load: dict[str, _TensorInfo]  # expected names
    scales: dict[str, _TensorInfo]  # expected fp8 name -> its scale_inv
    skipped_mtp: list[str]
    unexpected: list[str]


def _plan(
    tensors: dict[str, _TensorInfo],
    slots: dict[str, _Slot],
    cfg: ModelConfig,
) -> _Plan:
    """Classify checkpoint tensors and validate names, shapes and FP8 scales."""
    block = cfg.weight_block_size or DEFAULT_WEIGHT_BLOCK
    plan = _Plan({}, {}, [], [])
    for name in sorted(tensors, key=_natural_key):
        m = _LAYER_RE.match(name)
        if name in slots:  # an MTP layer's tensors too, when the model has it
            plan.load[name] = tensors[name]
        elif name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in slots:
            pass  # checked with its weight below
        elif m and int(m.group(1)) >= cfg.num_hidden_layers:
            # The MTP layer when not built, and its copies of the embedding and the LM
            # head (`embed_tokens`, `shared_head.head`: the trunk's are used).
            plan.skipped_mtp.append(name)
        elif name.endswith("rotary_emb.inv_freq") or (
            name == "lm_head.weight" and cfg.tie_word_embeddings
        ):
            logger.debug("ignoring %s (not a parameter of this model)", name)
        else:
            plan.unexpected.append(name)

    for name, info in plan.load.items():
        if info.tag in _FP8_TAGS and name + SCALE_SUFFIX not in tensors:
            raise CheckpointError(
                f"tensor {name} is {info.tag} but the checkpoint has no {name}{SCALE_SUFFIX}"
                " to dequantize it with"
            )
    missing = [n for n in slots if n not in tensors]
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} of the {len(slots)} tensors the model "
            f"needs: {_first(missing)}"
        )

    bad_shapes: list[str] = []
    for name, info in plan.load.items():
        expected = slots[name].shape
        scale = tensors.get(name + SCALE_SUFFIX)
        if info.tag in _FP8_TAGS:
            if len(info.shape) != 2:
                raise CheckpointError(f"fp8 tensor {name} has shape {info.shape}; only 2-D blocks")
            want = tuple(-(-d // b) for d, b in zip(info.shape, block, strict=True))
            if scale.shape != want:
                raise CheckpointError(
                    f"tensor {name}{SCALE_SUFFIX}: expected shape {want} for weight "
                    f"{info.shape} with block {block}, got {scale.shape}; check "
                    "quantization_config.weight_block_size"
                )
            if slots[name].dtype not in _FP8_DTYPES:  # kept FP8: the scale is a leaf too
                plan.scales[name] = scale
        elif scale is not None:
            plan.unexpected.append(name + SCALE_SUFFIX)  # a scale for an unquantized weight
        if info.shape != expected:
            bad_shapes.append(f"{name}: expected {expected}, got {info.shape}")
    if bad_shapes:
        raise CheckpointError(
            f"{len(bad_shapes)} tensor(s) have the wrong shape for this config: "
            f"{_first(bad_shapes)}"
        )
    return plan


# ---- loading -------------------------------------------------------------------------

Fp8Mode = Literal["keep", "dequantize"]
FP8_MODES: tuple[str, ...] = get_args(Fp8Mode)


def fp8_weight_names(model: CausalLM) -> list[str]:
    """HF names of the weights the official FP8 checkpoints quantize: every linear layer
    and routed expert of the decoder layers except the indexer's `weights_proj` (stored
    bf16 there, like the router, embeddings, LM head and norms)."""
    names = []
    for path, node in nnx.iter_graph(model):
        if not path or path[:2] != ("model", "layers"):
            continue
        prefix = ".".join(str(p) for p in path)
        if isinstance(node, Linear) and path[-1] != "weights_proj":
            names.append(f"{prefix}.weight")
        elif isinstance(node, RoutedExperts):
            n = node.gate_proj.shape[0]
            names += [f"{prefix}.{e}.{p}.weight" for e in range(n) for p in EXPERT_PROJS]
    return names


def apply_fp8(model: CausalLM, block: tuple[int, int], names: Collection[str]) -> int:
    """Turn the layers whose HF weight names are in `names` into FP8 block-quantized ones
    (abstract leaves, for the loader to fill). Experts go all or none per layer. Returns
    the number of layers converted."""
    names = set(names)
    converted = 0
    for path, node in list(nnx.iter_graph(model)):
        prefix = ".".join(str(p) for p in path)
        if isinstance(node, Linear) and f"{prefix}.weight" in names:
            node.to_fp8(block)
            converted += 1
        elif isinstance(node, RoutedExperts):
            n = node.gate_proj.shape[0]
            want = [f"{prefix}.{e}.{p}.weight" for e in range(n) for p in EXPERT_PROJS]
            hits = sum(w in names for w in want)
            if hits == len(want):
                node.to_fp8(block)
                converted += 1
            elif hits:
                raise CheckpointError(
                    f"{prefix}: {hits} of the {len(want)} expert weights are FP8 and the rest "
                    "are not; the loader keeps a layer's experts in one format (load with "
                    "`fp8='dequantize'`)"
                )
    return converted


def abstract_model(
    cfg: ModelConfig,
    dtype: DTypeLike = jnp.float32,
    param_dtype: DTypeLike = jnp.float32,
    *,
    fp8_block: tuple[int, int] | None = None,
    mtp: bool = False,
) -> CausalLM:
    """The model's structure, no data. `fp8_block`: FP8 where the official checkpoints
    are (`fp8_weight_names`), for sizing a model without its files (`bench_memory`)."""
    model = _abstract_model(cfg, dtype, param_dtype, mtp)
    if fp8_block is not None:
        apply_fp8(model, fp8_block, fp8_weight_names(model))
    return model


def _checkpoint_layout(
    model: CausalLM,
    cfg: ModelConfig,
    tensors: Mapping[str, _TensorInfo],
    fp8: Fp8Mode,
    *,
    log: bool = False,
) -> CausalLM:
    """`model` (abstract or concrete) with its layers FP8 where the checkpoint is
    F8_E4M3 and `fp8="keep"` (in place; returned); `"dequantize"` leaves it as is."""
    fp8_names = [n for n, info in tensors.items() if info.tag in _FP8_TAGS]
    if fp8 != "keep" or not fp8_names:
        return model
    odd = [n for n in fp8_names if tensors[n].tag != "F8_E4M3"]
    if odd:
        raise CheckpointError(
            f"{len(odd)} tensor(s) are {tensors[odd[0]].tag}, which the device path "
            f"does not keep (only F8_E4M3): {_first(odd)}; load with `fp8='dequantize'`"
        )
    block = cfg.weight_block_size or DEFAULT_WEIGHT_BLOCK
    converted = apply_fp8(model, block, fp8_names)
    if log:
        logger.info("keeping %d FP8 layers as FP8 + block scales %s", converted, block)
    return model


def checkpoint_model(
    cfg: ModelConfig,
    model_path: str | Path,
    *,
    dtype: DTypeLike = jnp.float32,
    param_dtype: DTypeLike = jnp.float32,
    fp8: Fp8Mode = "keep",
    mtp: bool = False,
) -> CausalLM:
    """The ABSTRACT model laid out as `load_hf_weights(cfg, model_path, dtype=...,
    param_dtype=..., fp8=..., mtp=...)` will load it, from the checkpoint's headers alone
    (no tensor data read): FP8 + block scales where the checkpoint has F8_E4M3 weights
    and `fp8="keep"`, else `param_dtype`. For sizing a load before it happens
    (`serving.prefill.memory_plan`)."""
    _check_fp8_mode(fp8)
    tensors = _checkpoint_tensors(Path(model_path))
    model = _abstract_model(cfg, dtype, param_dtype, mtp)
    return _checkpoint_layout(model, cfg, tensors, fp8)


def _check_fp8_mode(fp8: str) -> None:
    if fp8 not in FP8_MODES:
        raise CheckpointError(f"`fp8` must be one of {FP8_MODES}, got {fp8!r}")


@dataclasses.dataclass
class LoadStats:
    """What one process read: bytes of tensor data (headers excluded), tensors, seconds."""

    bytes_read: int = 0
    tensors_read: int = 0
    planned_bytes: int = 0  # what the plan said this process would read
    seconds: float = 0.0


def load_hf_weights(
    model_or_cfg: CausalLM | ModelConfig,
    model_path: str | Path,
    *,
    dtype: DTypeLike = jnp.float32,
    param_dtype: DTypeLike = jnp.float32,
    strict: bool = False,
    progress: bool = True,
    fp8: Fp8Mode = "keep",
    mesh: Mesh | None = None,
    expert_axis: str | tuple[str, ...] | None = None,
    stats: LoadStats | None = None,
    mtp: bool = False,
) -> CausalLM:
    """Load a HF safetensors checkpoint (`model.safetensors` or sharded + index json).

    `mtp`: with a `ModelConfig`, build and load the checkpoint's MTP layer too
    (`CausalLM(mtp=True)`; its tensors are skipped otherwise).

    Given a `ModelConfig`, builds the model (`dtype` compute, `param_dtype` weights; norms
    and the router stay float32 as `CausalLM` defines them) without a random init. Given a
    `CausalLM`, overwrites its parameters in place (keeping its dtypes; `dtype` and
    `param_dtype` are then unused) and returns it. `strict=True` turns unexpected tensors
    into an error instead of a warning. Raises `CheckpointError` naming the tensor for
    missing tensors, wrong shapes, missing files or a bad index.

    FP8 block-quantized tensors stay FP8 with their scales (`fp8="keep"`, dequantized in
    the jitted step) or are dequantized here in float32 and cast to the leaf dtype
    (`"dequantize"`, the comparison path).

    Placement: with `mesh`, every leaf is built straight into its shards on the mesh's
    devices (`expert_axis`: routed experts split over that axis, the rest replicated) by
    `jax.make_array_from_callback`, so a process reads from the files only the tensors
    its own devices hold - for an expert shard, just those experts - and host memory
    peaks at one leaf's local shard (the largest replicated tensor or one device's
    experts of one projection), never the checkpoint. Without `mesh`, a given model's
    leaves keep their shardings and a new one's are uncommitted on the default device. `stats`, if
    given, is filled with what this process read.
    """
    _check_fp8_mode(fp8)
    model_path = Path(model_path)
    tensors = _checkpoint_tensors(model_path)
    if isinstance(model_or_cfg, ModelConfig):
        cfg, model = model_or_cfg, _abstract_model(model_or_cfg, dtype, param_dtype, mtp)
    else:
        cfg, model = model_or_cfg.cfg, model_or_cfg
    # The layout `checkpoint_model` predicts: FP8 layers where the checkpoint has them.
    _checkpoint_layout(model, cfg, tensors, fp8, log=True)
    block = cfg.weight_block_size or DEFAULT_WEIGHT_BLOCK
    state = nnx.state(model)
    slots = _layout(state)
    plan = _plan(tensors, slots, cfg)

    if plan.skipped_mtp:
        logger.info(
            "skipping %d tensors of layers >= num_hidden_layers=%d "
            "(MTP layers, or layers an override cut)",
            len(plan.skipped_mtp),
            cfg.num_hidden_layers,
        )
    if plan.unexpected:
        msg = (
            f"checkpoint {model_path} has {len(plan.unexpected)} tensor(s) this model does "
            f"not use: {_first(plan.unexpected)}"
        )
        if strict:
            raise CheckpointError(msg + " (strict=True)")
        logger.warning("%s; ignoring them", msg)

    flat = nnx.to_flat_state(state)
    if mesh is not None:
        placed = dict(nnx.to_flat_state(expert_parallel.param_shardings(state, mesh, expert_axis)))
        shardings = {path: _unwrap(placed[path]) for path, _ in flat}
    else:
        # None: an uncommitted array on the default device, free to follow the arrays it
        # is computed with (as `jax.device_put` without a device leaves it).
        shardings = {path: getattr(var.get_value(), "sharding", None) for path, var in flat}
    stats = LoadStats() if stats is None else stats
    values = _read_all(plan, slots, block, shardings, progress, stats)
    new_state = nnx.from_flat_state([(path, var.replace(values[path])) for path, var in flat])
    nnx.update(model, new_state)
    logger.info(
        "loaded %d tensors from %s: read %.3f GB in %.1f s (%.2f GB/s) on this process",
        len(plan.load),
        model_path,
        stats.bytes_read / 1e9,
        stats.seconds,
        stats.bytes_read / 1e9 / max(stats.seconds, 1e-9),
    )
    return model


def _unwrap(x: Any) -> Any:
    return x.get_value() if hasattr(x, "get_value") else x


def load_model(
    model_path: str | Path,
    *,
    dtype: DTypeLike = jnp.float32,
    param_dtype: DTypeLike | None = None,
    json_model_override_args: str | Mapping[str, Any] | None = None,
    strict: bool = False,
    progress: bool = True,
    fp8: Fp8Mode = "keep",
    mesh: Mesh | None = None,
    expert_axis: str | tuple[str, ...] | None = None,
    stats: LoadStats | None = None,
    mtp: bool = False,
) -> tuple[ModelConfig, CausalLM]:
    """`config.json` (+ overrides) and its weights from a HF model dir, in one call.

    `param_dtype` defaults to `dtype` (a bfloat16 run keeps bfloat16 weights); the rest
    as in `load_hf_weights`.
    """
    cfg = ModelConfig.from_pretrained(model_path, json_model_override_args)
    model = load_hf_weights(
        cfg,
        model_path,
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else param_dtype,
        strict=strict,
        progress=progress,
        fp8=fp8,
        mesh=mesh,
        expert_axis=expert_axis,
        stats=stats,
        mtp=mtp,
    )
    return cfg, model


def _index_key(index: tuple[slice, ...]) -> tuple[tuple[int | None, int | None], ...]:
    return tuple((sl.start, sl.stop) for sl in index)


def _read_all(
    plan: _Plan,
    slots: dict[str, _Slot],
    block: tuple[int, int],
    shardings: dict[tuple[str | int, ...], Any],
    progress: bool,
    stats: LoadStats,
) -> dict[tuple[str | int, ...], jax.Array]:
    """Build every leaf from the files, shard by shard, on this process's devices only."""
    by_path: dict[tuple[str | int, ...], dict[int | None, str]] = {}
    for name, slot in slots.items():
        by_path.setdefault(slot.path, {})[slot.expert] = name
    leaf_shapes = {
        path: (len(names), *slots[names[0]].shape) if 0 in names else slots[names[None]].shape
        for path, names in by_path.items()
    }
    leaf_dtypes = {path: slots[next(iter(names.values()))].dtype for path, names in by_path.items()}

    def tensor_bytes(name: str) -> int:
        info = plan.load[name]
        total = info.end - info.begin
        if name in plan.scales:
            total += plan.scales[name].end - plan.scales[name].begin
        return total

    # What this process will read: per leaf, the experts (or the whole tensor) its
    # addressable shards cover, each once however many local devices share it.
    wanted: dict[tuple[str | int, ...], list[str]] = {}
    for path, names in by_path.items():
        whole = {None: tuple(slice(None) for _ in leaf_shapes[path])}
        sharding = shardings[path]
        index_map = (
            whole
            if sharding is None
            else sharding.addressable_devices_indices_map(leaf_shapes[path])
        )
        if None in names:
            wanted[path] = [names[None]] if index_map else []
            continue
        experts: set[int] = set()
        for index in index_map.values():
            experts.update(range(len(names))[index[0]])
        wanted[path] = [names[e] for e in sorted(experts)]
    stats.planned_bytes = sum(tensor_bytes(n) for ns in wanted.values() for n in ns)

    start = time.perf_counter()
    values: dict[tuple[str | int, ...], jax.Array] = {}
    with (
        contextlib.ExitStack() as stack,
        tqdm(
            total=stats.planned_bytes,
            desc="loading weights",
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            disable=not progress,
        ) as bar,
    ):
        reader = _Reader(stack)

        def read(name: str) -> np.ndarray:
            arr = reader.read(name, plan.load[name])
            if name in plan.scales:  # dequantize-at-load path
                arr = dequantize_np(arr, reader.read(name, plan.scales[name]), block)
            nbytes = tensor_bytes(name)
            stats.bytes_read += nbytes
            stats.tensors_read += 1
            bar.update(nbytes)
            return arr.astype(slots[name].dtype, copy=False)

        # Files are visited in order, front to back within each, leaf by leaf.
        def first_offset(path: tuple[str | int, ...]) -> tuple[Any, int]:
            info = plan.load[next(iter(by_path[path].values()))]
            return _natural_key(info.file.name), info.begin

        for path in sorted(by_path, key=first_offset):
            names = by_path[path]
            cache: dict[Any, np.ndarray] = {}  # one host copy per distinct local shard

            def shard(index: tuple[slice, ...], names=names, cache=cache) -> np.ndarray:
                key = _index_key(index)
                if key not in cache:
                    cache.clear()  # devices come in index order: keep one shard at a time
                    if None in names:
                        cache[key] = read(names[None])[index]
                    else:
                        picked = range(len(names))[index[0]]
                        cache[key] = np.stack([read(names[e]) for e in picked])[
                            (slice(None), *index[1:])
                        ]
                return cache[key]

            if shardings[path] is None:
                full = tuple(slice(None) for _ in leaf_shapes[path])
                values[path] = jax.device_put(shard(full))
            else:
                values[path] = jax.make_array_from_callback(
                    leaf_shapes[path], shardings[path], shard, dtype=leaf_dtypes[path]
                )
    stats.seconds = time.perf_counter() - start
    return values


# ---- writing safetensors -------------------------------------------------------------


def save_hf_weights(
    model: CausalLM,
    out_dir: str | Path,
    *,
    max_shard_bytes: int | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> list[Path]:
    """Write the model's parameters as HF-named safetensors in their own dtypes (with an
    MTP layer, also its copies of the embedding and the LM head, as released checkpoints).

    One `model.safetensors`, or with `max_shard_bytes` shards `model-0000k-of-0000n`
    (a tensor larger than the limit gets a shard of its own) plus `model.safetensors.index.json`.
    Checkpoint files of either layout already in `out_dir` are replaced. `fp8_block`
    block-quantizes the weights the official FP8 checkpoints quantize
    (`fp8_weight_names`) to `float8_e4m3fn` + `weight_scale_inv`. Returns the
    safetensors paths written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [
        out_dir / SINGLE_FILE,
        out_dir / INDEX_FILE,
        *out_dir.glob("model-*-of-*.safetensors"),
    ]:
        stale.unlink(missing_ok=True)
    tensors = hf_state_dict(model)
    if model.mtp is not None:
        # The released checkpoints repeat the embedding and the LM head inside the MTP
        # layer (`load_hf_weights` skips them: the trunk's are used); so do we.
        mtp = f"model.layers.{model.cfg.num_hidden_layers}"
        head = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
        tensors[f"{mtp}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors[f"{mtp}.shared_head.head.weight"] = tensors[head].copy()
    if fp8_block is not None:
        for name in fp8_weight_names(model):
            if tensors[name].dtype in _FP8_DTYPES:
                continue  # already FP8 (a model loaded with fp8="keep")
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_np(tensors[name], fp8_block)
        tensors = dict(sorted(tensors.items(), key=lambda kv: _natural_key(kv[0])))
    metadata = {"format": "pt"}  # what transformers expects of a safetensors checkpoint
    if max_shard_bytes is None:
        path = out_dir / SINGLE_FILE
        save_file(tensors, str(path), metadata=metadata)
        logger.info("wrote %d tensors to %s", len(tensors), path)
        return [path]
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")

    shards: list[list[str]] = [[]]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += arr.nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}
    paths: list[Path] = []
    for k, names in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{n:05d}.safetensors"
        save_file({nm: tensors[nm] for nm in names}, str(out_dir / file), metadata=metadata)
        weight_map.update(dict.fromkeys(names, file))
        paths.append(out_dir / file)
    index = {
        "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
        "weight_map": weight_map,
    }
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    logger.info("wrote %d tensors in %d shards to %s", len(tensors), n, out_dir)
    return paths


# ---- orbax snapshots -----------------------------------------------------------------


def save_state(model: nnx.Module, ckpt_dir: str | Path, *, force: bool = False) -> Path:
    """Snapshot `nnx.state(model)` with orbax (exact, any dtype). Returns the absolute dir.

    An existing `ckpt_dir` is an error unless `force=True` (then it is overwritten).
    """
    path = Path(ckpt_dir).absolute()
    if path.exists() and not force:
        raise CheckpointError(f"{path} already exists; pass force=True to overwrite it")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, nnx.state(model), force=force)
        ckptr.wait_until_finished()
    logger.info("saved model state to %s", path)
    return path


def restore_state(
    cfg_or_model: ModelConfig | CausalLM,
    ckpt_dir: str | Path,
    *,
    dtype: DTypeLike = jnp.float32,
    param_dtype: DTypeLike = jnp.float32,
) -> CausalLM:
    """Restore a `save_state` snapshot into a new model (from a config) or a given one.

    A given model (abstract from `nnx.eval_shape`, or concrete) supplies the structure,
    dtypes and shardings and is updated in place; `dtype` / `param_dtype` only apply
    when building from a `ModelConfig`, and must match what was saved.
    """
    path = Path(ckpt_dir).absolute()
    if not path.is_dir():
        raise CheckpointError(f"orbax checkpoint directory {path} does not exist")
    model = (
        _abstract_model(cfg_or_model, dtype, param_dtype)
        if isinstance(cfg_or_model, ModelConfig)
        else cfg_or_model
    )
    graphdef, state = nnx.split(model)
    target = jax.tree.map(_as_restore_target, state)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path, target)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise CheckpointError(
            f"cannot restore {path} into this model (was it saved from the same config and "
            f"dtypes?): {e}"
        ) from e
    if isinstance(cfg_or_model, ModelConfig):
        return nnx.merge(graphdef, restored)
    nnx.update(model, restored)
    return model


def _as_restore_target(x: Any) -> Any:
    """Concrete arrays become shape/dtype/sharding structs; abstract ones pass through."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
