"""Hugging Face safetensors -> jaxserve weight pytree, placed directly onto its shardings.

Tensors are read one at a time (memory-mapped), renamed, transposed to our input-features-first
layout, cast, checked against the declared shape and put onto their target sharding, so a device
never holds more than its shard of the weights plus one tensor in flight.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open

from checkpoints import quantized
from checkpoints.hf_names import is_mtp_layer, name_table, text_model, unfused
from jaxserve.core.config import ModelConfig
from jaxserve.model import weights as W
from jaxserve.quant import host as quant_host
from jaxserve.quant import mxfp4
from jaxserve.parallel.sharding import DEFAULT_RULES, Rules, put

# Tensors transformers may store that carry no weights we need.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def resolve_model_dir(name_or_path: str | Path, marker: str = "config.json", what: str = "model") -> Path:
    """A local directory, or a hub id found in huggingface_hub's local cache (never downloads).
    `marker`: the file the directory must hold (a LoRA adapter's is adapter_config.json)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / marker).is_file():
            raise FileNotFoundError(f"{path} has no {marker}: not a Hugging Face {what} directory")
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; pass the {what} directory that holds {marker}")
    name = str(name_or_path)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{what} directory {name!r} does not exist")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception as e:  # the hub raises several types for "not cached"
        why = "" if isinstance(e, LocalEntryNotFoundError) else f" ({type(e).__name__}: {e})"
        # `from None`: the hub's chained traceback says nothing the message does not.
        raise FileNotFoundError(
            f"{what} {name!r} is neither a local directory nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}){why}, and jaxserve never downloads. Fetch it first with "
            f"`hf download {name}` (on a machine with network access; the `hf` command comes with "
            f"huggingface_hub), or pass a local directory with {marker} and *.safetensors.") from None


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"safetensors shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


logger = logging.getLogger("jaxserve.checkpoints")

_RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "BF16": ml_dtypes.bfloat16,
               "F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "U8": np.uint8,
               "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_}


def _header(file: Path) -> tuple[int, dict[str, dict]]:
    """A safetensors file's header (8-byte little-endian length, then JSON of each tensor's dtype,
    shape and data offsets): (its length, tensor name -> entry). Read once per file and load."""
    with open(file, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        entries = json.loads(fh.read(n))
    entries.pop("__metadata__", None)
    return n, entries


def _memmap(file: Path, header_len: int, entries: dict[str, dict], name: str) -> np.ndarray:
    """One tensor as a read-only memory map at its offsets: nothing is read until an element is."""
    entry = entries[name]
    if entry["dtype"] not in _RAW_DTYPES:
        raise ValueError(f"tensor {name!r} in {file.name} has unsupported dtype {entry['dtype']}")
    start, end = entry["data_offsets"]
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len + start, shape=(end - start,))
    return data.view(_RAW_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _iter_tensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(name, read) per tensor; lazy: read returns a memory map (see _memmap). Each file's header is
    parsed once, however many tensors are read from it."""
    for file in files:
        header = functools.cache(functools.partial(_header, file))  # parsed on the first mapped read only
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                def read(f=f, name=name, file=file, header=header) -> np.ndarray:
                    if lazy:
                        return _memmap(file, *header(), name)
                    try:
                        return f.get_tensor(name)
                    except (AttributeError, TypeError, ValueError):  # numpy has no float8
                        return np.array(_memmap(file, *header(), name))
                yield name, read


def _reported(tensors: Iterator[Any], total: int, progress: Callable[[int, int], None]) -> Iterator[Any]:
    """`tensors`, calling progress(done, total) before the first and once each is handled (placed
    asynchronously: nothing waits on a device for the sake of the count)."""
    progress(0, total)
    for done, item in enumerate(tensors, 1):
        yield item
        progress(done, total)


def read_safetensors(file: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file (small files: LoRA adapters), any stored dtype."""
    return {name: read() for name, read in _iter_tensors([Path(file)])}


def tensor_names(model_dir: str | Path) -> set[str]:
    """Every tensor name of a checkpoint (headers only)."""
    names: set[str] = set()
    for file in _safetensors_files(Path(model_dir)):
        with safe_open(str(file), framework="numpy") as f:
            names.update(f.keys())
    return names


# leaves whose vocabulary axis is stored with vocab_size rows and placed padded to padded_vocab (zeros)
_VOCAB_AXIS = {("embed",): 0, ("lm_head",): 1}


def _stored_shape(path: tuple[Any, ...], shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...]:
    """The shape a checkpoint stores for a leaf declared `shape`: the vocabulary unpadded, and packed
    MXFP4 experts at their own width (weights.abstract pads it: mxfp4.padded_width)."""
    axis = _VOCAB_AXIS.get(path)
    if axis is not None:
        return shape[:axis] + (cfg.vocab_size,) + shape[axis + 1:]
    if cfg.moe is not None and cfg.moe.expert_format == "mxfp4" and len(path) >= 3:
        width = cfg.moe.intermediate_size
        field, part = path[2], path[3] if len(path) == 4 else None
        if field in ("we_gate", "we_up", "be_gate", "be_up"):   # [E, Fe, ...] blocks / scales, [E, Fe] biases
            return shape[:1] + (width,) + shape[2:]
        if field == "we_down" and part is not None:              # [E, D, Fe / 32, ...]
            return shape[:2] + (width // mxfp4.BLOCK,) + shape[3:]
    return shape


def _zero_padded(part: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`part` with zeros appended on each axis up to `shape`."""
    if part.shape == tuple(shape):
        return part
    return np.pad(part, [(0, want - have) for want, have in zip(shape, part.shape)])


class SliceReads:
    """Places host tensors (memory maps) by reading, for each of this process's devices, only its
    slice; counts the distinct bytes read."""

    def __init__(self) -> None:
        self.read = 0
        self.total = 0
        self._seen: set[tuple[int, tuple[tuple[int, int], ...]]] = set()  # (tensor, slice) read
        self._tensors = 0

    def place(self, host: np.ndarray, shape: tuple[int, ...], placement: Any, dtype: Any) -> jax.Array:
        """host: shorter than `shape` only on a padded vocabulary axis (its rows past the stored ones
        are zeros); placement: the leaf's sharding."""
        self.total += host.nbytes
        self._tensors += 1
        tensor = self._tensors

        def read(index: tuple[slice, ...]) -> np.ndarray:
            bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
            stored = tuple(slice(min(a, m), min(b, m)) for (a, b), m in zip(bounds, host.shape))
            part = np.asarray(host[stored])
            key = (tensor, tuple((s.start, s.stop) for s in stored))
            if key not in self._seen:
                self._seen.add(key)
                self.read += part.nbytes
            return _zero_padded(part.astype(dtype), tuple(b - a for a, b in bounds))

        return jax.make_array_from_callback(shape, placement, read)


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key] if isinstance(key, int) else getattr(tree, key)
    return tree


def _expert_of(path: tuple[Any, ...]) -> tuple[tuple[Any, ...], int | None]:
    """(the leaf's path, the expert index) of a table path: one expert's slice of a stacked [E, ...]
    leaf ends in an int; any other path is the leaf's own (a part of a struct leaf ends in a name)."""
    if len(path) == 4 and isinstance(path[3], int):
        return path[:3], path[3]
    return path, None


def _one_expert(spec: Any) -> Any:
    """A stacked quantized leaf's declaration for one expert: every ParamSpec without its expert axis."""
    def drop(ps: Any) -> Any:
        return None if ps is None else dataclasses.replace(
            ps, shape=ps.shape[1:], axes=ps.axes[1:], contract=tuple(a - 1 for a in ps.contract))
    return spec.replace(qvalue=drop(spec.qvalue), scale=drop(spec.scale), zero_point=drop(spec.zero_point))


def _stacked(parts: list[Any]) -> Any:
    """Experts' host arrays (plain, or quantized leaves) stacked on a new first axis."""
    if not W.is_quantized(parts[0]):
        return np.stack(parts)
    zero = None if parts[0].zero_point is None else np.stack([p.zero_point for p in parts])
    return parts[0].replace(qvalue=np.stack([p.qvalue for p in parts]), scale=np.stack([p.scale for p in parts]),
                            zero_point=zero)


def _set(tree: W.Weights, path: tuple[Any, ...], value: Any) -> W.Weights:
    """`value` at `path`: a leaf, or one part of a struct leaf (("layers", i, field, part): a packed
    MXFP4 projection's blocks or scales)."""
    if path[0] == "layers":
        layers = list(tree.layers)
        if len(path) == 4:
            value = getattr(layers[path[1]], path[2]).replace(**{path[3]: value})
        layers[path[1]] = layers[path[1]].replace(**{path[2]: value})
        return tree.replace(layers=layers)
    return tree.replace(**{path[0]: value})


def _gathered_experts(experts: dict[tuple[Any, ...], dict[int, Any]], path: tuple[Any, ...], expert: int, host: Any,
                      num_experts: int) -> Any:
    """One expert's host arrays kept until its leaf has every expert: then the stacked leaf (and the
    experts forgotten), else None."""
    stack = experts.setdefault(path, {})
    stack[expert] = host
    if len(stack) < num_experts:
        return None
    del experts[path]
    return _stacked([stack[e] for e in range(num_experts)])


def load_weights(model_dir: str | Path, cfg: ModelConfig, mesh: Mesh, dtype: Any = jnp.float32,
                 rules: Rules = DEFAULT_RULES, slices: SliceReads | None = None,
                 progress: Callable[[int, int], None] | None = None) -> W.Weights:
    """Reads every tensor of the checkpoint onto its sharding; errors name the offending tensor.

    Quantized leaves are filled on the host before placement: by quantizing the full-precision
    tensor (online schemes), or by unpacking a pre-quantized Linear's tensors once all of them
    have been read (checkpoints/quantized.py).

    slices: read each plain tensor through a memory map, only the slices this process's devices
    hold (the default when several processes share the mesh: multi-host, where each host reads
    its own shards); the count of bytes read is left in it. Quantized and expert tensors are
    read whole. progress: called with (tensors read, tensors in the files) as they load."""
    model_dir = Path(model_dir)
    if slices is None and jax.process_count() > 1:
        slices = SliceReads()
    spec_tree = W.abstract(cfg, dtype)
    sharding_tree = W.shardings(spec_tree, cfg, mesh, rules)
    table = name_table(cfg)
    q = cfg.quantization
    # Pre-quantized formats: HF module prefix -> its "<prefix>.weight" table entry, per quantized leaf.
    modules: dict[str, str] = {}
    needed: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    if q is not None and q.checkpoint_format is not None:
        needed, ignored = quantized.parts_of(q)
        modules = {n[: -len(".weight")]: n for n, (path, _) in table.items()
                   if n.endswith(".weight") and W.is_quantized(_get(spec_tree, _expert_of(path)[0]))}
    pending: dict[str, dict[str, np.ndarray]] = {}
    out = jax.tree.map(lambda _: None, spec_tree, is_leaf=lambda x: W.is_spec(x) or W.is_quantized(x))
    experts: dict[tuple[Any, ...], dict[int, np.ndarray]] = {}  # MoE leaves still missing experts
    seen: set[str] = set()      # table entries placed
    received: set[str] = set()  # every tensor name read
    files = _safetensors_files(model_dir)
    tensors = _iter_tensors(files, lazy=slices is not None)
    if progress is not None:
        tensors = _reported(tensors, sum(len(_header(f)[1]) for f in files), progress)
    # fp8-block Linears whose leaves are plain (their blocks do not tile the leaf, or they are split at
    # load) arrive dequantized; the MTP layer's are skipped below as they are
    names = lambda: (n for n, _ in text_model(((n, None) for f in files for n in _header(f)[1]), cfg))  # noqa: E731
    plain = {p for p in quantized.scaled_modules(names, q) - set(modules) if not is_mtp_layer(p + ".weight", cfg)}
    for name, read in unfused(quantized.widened(text_model(tensors, cfg), plain, q), cfg):
        if name in received:
            raise ValueError(f"tensor {name!r} appears in more than one safetensors file")
        received.add(name)
        prefix, _, part = name.rpartition(".")
        if prefix in modules and (name == modules[prefix] or name not in table):  # a quantized Linear's part
            # (its bias, a table entry of its own, is a plain tensor)
            path, expert = _expert_of(table[modules[prefix]][0])
            spec = _get(spec_tree, path)
            if expert is not None:
                spec = _one_expert(spec)
            if part == "g_idx" and not q.act_order:
                quantized.check_g_idx(read(), math.prod(spec.qvalue.shape[a] for a in spec.qvalue.contract),
                                      q.group_size, prefix)
                continue
            if part in ignored:
                continue
            if part not in needed:
                raise ValueError(f"unexpected tensor {name!r} for a {q.method} checkpoint (a quantized Linear "
                                 f"has {', '.join(needed)})")
            parts = pending.setdefault(prefix, {})
            parts[part] = read()
            if all(p in parts for p in needed):
                pad = W.padded_vocab(cfg) - cfg.vocab_size if path == ("lm_head",) else 0
                host = quantized.assemble(pending.pop(prefix), q, spec, prefix, pad)
                seen.add(modules[prefix])
                if expert is not None:
                    host = _gathered_experts(experts, path, expert, host, _get(spec_tree, path).qvalue.shape[0])
                    if host is None:
                        continue
                out = _set(out, path, put(host, _get(sharding_tree, path)))
            continue
        if name not in table:
            if _IGNORED.match(name) or (cfg.tie_word_embeddings and name == "lm_head.weight") or is_mtp_layer(name, cfg):
                continue
            raise ValueError(f"unexpected tensor {name!r} in {model_dir} for a {cfg.architecture} config")
        seen.add(name)
        path, transform = table[name]
        path, expert = _expert_of(path)
        spec = _get(spec_tree, path)
        online = W.is_quantized(spec)
        shape = spec.qvalue.shape if online else spec.shape
        shape = shape[1:] if expert is not None else shape
        raw = read()
        try:
            host = transform(raw)
        except ValueError as e:
            raise ValueError(f"tensor {name!r} has shape {raw.shape}, which does not fit the config: {e}") from e
        if host.shape != _stored_shape(path, shape, cfg):
            raise ValueError(f"tensor {name!r} has shape {tuple(raw.shape)} (as {host.shape} after layout), "
                             f"expected {_stored_shape(path, shape, cfg)} from config.json")
        if slices is not None and expert is None and not online:
            out = _set(out, path, slices.place(host, spec.shape, _get(sharding_tree, path), jnp.dtype(spec.dtype)))
            continue
        host = _zero_padded(np.ascontiguousarray(host), shape)
        if expert is not None:
            host = _gathered_experts(experts, path, expert, host.astype(jnp.dtype(dtype)),
                                     (spec.qvalue if online else spec).shape[0])
            if host is None:
                continue
        if online:  # quantized on the host, so only the packed values are placed (experts: each its own tiles)
            values, scale = quant_host.quantize(host, spec.qtype, spec.scale.shape)
            host = spec.replace(qvalue=values, scale=scale.astype(jnp.dtype(dtype)))
        elif expert is None:
            host = host.astype(jnp.dtype(spec.dtype))  # the declared dtype (a float32 expert bias)
        out = _set(out, path, put(host, _get(sharding_tree, path)))
    for prefix, parts in pending.items():
        raise ValueError(f"checkpoint in {model_dir} has only {sorted(parts)} of {prefix!r}; a {q.method} "
                         f"Linear needs {', '.join(needed)}")
    missing = sorted(set(table) - seen)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} is missing tensors: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    if slices is not None:
        logger.info("read %.1f MiB of the %.1f MiB of unquantized tensors: the slices of this process's devices",
                    slices.read / 2**20, slices.total / 2**20)
    return out
