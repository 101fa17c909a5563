"""Convert between the per-block layout (``Transformer/encoderblock_{i}/...``) and the scanned one.

With ``model.scan=True`` the leading run of identical blocks, blocks 0..k-1, is one ``nn.scan``
whose variables are stacked on a leading depth axis under ``Transformer/encoderblock/...`` (the
big_vision layout); blocks k..depth-1, if any, keep their names ``encoderblock_{i}``. k is
``ViTSpec.scan_length``: the whole depth unless a norm override or a late class token makes
the blocks differ.

Both helpers walk any pytree (a params dict, a whole TrainState with its optimizer moments, the
``batch_stats`` or ``intermediates`` collections, or a flat '/'-keyed .npz dict) and convert every
dict that holds the blocks; other leaves pass through. Converting there and back is exact.
This module is the only place that stacks or unstacks blocks (checkpoints, .npz files, analysis).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import numpy as np

STACKED = "encoderblock"
_BLOCK = re.compile(r"^encoderblock_(\d+)$")
_FLAT_BLOCK = re.compile(r"^(.*?)(?:^|/)encoderblock_(\d+)/(.*)$")
_FLAT_STACKED = re.compile(r"^(.*?)(?:^|/)encoderblock/(.*)$")


def _is_block_holder(x: Any) -> bool:
    return isinstance(x, Mapping) and any(
        k == STACKED or _BLOCK.match(str(k)) or "encoderblock" in str(k) and "/" in str(k)
        for k in x)


def _stack(values: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: (np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs)
                                     else jax.numpy.stack(xs)), *values)


def _unstack(value: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], value)


def _flat_key(prefix: str, rest: str, i: int | None) -> str:
    name = STACKED if i is None else f"{STACKED}_{i}"
    return f"{prefix}/{name}/{rest}" if prefix else f"{name}/{rest}"


def _unstack_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        k = str(k)
        m = _FLAT_STACKED.match(k) if "/" in k else None
        if k == STACKED:
            n = _depth_of(v, k)
            for i in range(n):
                if f"{STACKED}_{i}" in d:
                    raise ValueError(f"both '{STACKED}' (stacked, {n} blocks) and '{STACKED}_{i}' "
                                     "are present: the stacked run must cover blocks 0..k-1 only")
                out[f"{STACKED}_{i}"] = _unstack(v, i)
        elif m:
            for i in range(_depth_of(v, k)):
                out[_flat_key(m.group(1), m.group(2), i)] = np.asarray(v)[i]
        else:
            out[k] = v
    return out


def _depth_of(v: Any, where: str) -> int:
    depths = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in jax.tree.leaves(v)}
    if len(depths) != 1 or -1 in depths:
        raise ValueError(f"{where}: stacked blocks need one common leading depth axis, got "
                         f"leading sizes {sorted(depths)}")
    return depths.pop()


def _stack_dict(d: Mapping[str, Any], length: int | None) -> dict[str, Any]:
    d = {str(k): v for k, v in d.items()}
    nested = sorted(int(m.group(1)) for k in d if (m := _BLOCK.match(k)))
    flat: dict[tuple[str, str], dict[int, Any]] = {}
    for k, v in d.items():
        m = _FLAT_BLOCK.match(k) if "/" in k else None
        if m:
            flat.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = v
    present = nested or sorted({i for per in flat.values() for i in per})
    if not present:
        return d
    n = length if length is not None else len(present)
    if n < 1 or present[:n] != list(range(n)):
        raise ValueError(f"cannot stack blocks 0..{n - 1}: the tree has blocks {present}")
    out = dict(d)
    if nested:
        out[STACKED] = _stack([d[f"{STACKED}_{i}"] for i in range(n)])
        for i in range(n):
            del out[f"{STACKED}_{i}"]
    for (prefix, rest), per in flat.items():
        out[_flat_key(prefix, rest, None)] = np.stack([np.asarray(per[i]) for i in range(n)])
        for i in range(n):
            del out[_flat_key(prefix, rest, i)]
    return out


def _map_holders(tree: Any, fn) -> Any:
    return jax.tree.map(lambda x: fn(x) if _is_block_holder(x) else x, tree,
                        is_leaf=_is_block_holder)


def unstack_blocks(tree: Any) -> Any:
    """Scanned -> per-block: ``encoderblock`` (leading axis k) becomes ``encoderblock_0..k-1``.

    A tree without stacked blocks is returned unchanged.
    """
    return _map_holders(tree, _unstack_dict)


def stack_blocks(tree: Any, length: int | None = None) -> Any:
    """Per-block -> scanned: ``encoderblock_0..length-1`` become ``encoderblock`` with a leading
    depth axis; later blocks keep their names. ``length`` None stacks every block.
    """
    return _map_holders(tree, lambda d: _stack_dict(d, length))


def is_scanned(tree: Any) -> bool:
    found = []
    _map_holders(tree, lambda d: found.append(any(k == STACKED or "/encoderblock/" in f"/{k}"
                                                  for k in d)) or d)
    return any(found)


def to_layout(tree: Any, spec: Any) -> Any:
    """Converts a tree in either layout to the one the model of ``spec`` (a ``ViTSpec``) uses."""
    flat = unstack_blocks(tree)
    if not spec.scan:
        return flat
    return stack_blocks(flat, spec.scan_length)
