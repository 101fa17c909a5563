"""Reads PyTorch state dicts (timm, DeiT) as flat name -> numpy arrays, for ``config.init_from``.

``.safetensors`` is read with the ``safetensors`` package (no torch); ``.pth``/``.pt``/``.bin``
need torch and are read with ``torch.load(weights_only=True)``, which refuses pickled code.
Floating tensors come back as float32 (bfloat16/float16 widen exactly). What the arrays mean is
``models.timm_layout``'s business.
"""
from __future__ import annotations

import os
import re
from typing import Any

import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16', which safetensors' numpy API needs)
import numpy as np
from etils import epath

from normvit_jax.models.google_layout import CheckpointError

SAFETENSORS = (".safetensors",)
TORCH = (".pth", ".pt", ".bin")
# Wrappers a training script puts around the weights: DeiT/timm's train.py save {'model': ...} or
# {'state_dict': ...} beside optimizer state. An EMA copy ('model_ema', 'state_dict_ema') is never
# taken silently: the raw weights are, as export's default (docs/pretrained.md).
WRAPPERS = ("model", "state_dict")
NO_TORCH = ("reading {path} needs torch: pip install -e '.[torch]' (a .safetensors file needs no "
            "torch: `safetensors.torch.save_file(model.state_dict(), 'FILE.safetensors')`)")


def is_state_dict_path(path: str) -> bool:
    """Whether ``path`` names a PyTorch state dict by its suffix (.safetensors/.pth/.pt/.bin)."""
    return str(path).lower().endswith(SAFETENSORS + TORCH)


def check(path: str, key: str = "path") -> None:
    """Raises CheckpointError (a ValueError: exit 2) naming the problem unless ``path`` is a file
    this module can read here (torch importable for .pth/.bin): preflight's check, before anything
    is written, and the loader's."""
    p = epath.Path(path)
    if not p.exists():
        raise CheckpointError(f"{key}={path!r} does not exist")
    if p.is_dir():
        raise CheckpointError(f"{key}={path!r} is a directory, not a state dict file")
    if str(path).lower().endswith(TORCH) and not _has_torch():
        raise CheckpointError(f"{key}: " + NO_TORCH.format(path=path))


def read(path: str) -> tuple[dict[str, np.ndarray], str]:
    """(flat name -> array, a note on what was unwrapped/widened) of a state dict file."""
    check(path)
    if str(path).lower().endswith(SAFETENSORS):
        raw = _read_safetensors(path)
    else:
        raw = _read_torch(path)
    notes = []
    for w in WRAPPERS:
        if isinstance(raw.get(w), dict):
            others = sorted(k for k in raw if k != w)
            notes.append(f"weights from {w!r}" + (f" (ignored: {', '.join(others)})" if others else ""))
            raw = raw[w]
            break
    if any(isinstance(v, dict) for v in raw.values()):
        nested = sorted(k for k, v in raw.items() if isinstance(v, dict))
        raise CheckpointError(f"{path}: a dict of dicts ({', '.join(nested)}), not a state dict; "
                              f"the weights are read from one of {list(WRAPPERS)}")
    if raw and all(k.startswith("module.") for k in raw):  # saved from DistributedDataParallel
        raw = {k[len("module."):]: v for k, v in raw.items()}
        notes.append("'module.' prefix removed")
    out, widened = {}, 0
    for k, v in raw.items():
        out[k], half = _to_numpy(v, path, k)
        widened += half
    if widened:
        notes.append(f"{widened} bfloat16/float16 tensors widened")
    if not out:
        raise CheckpointError(f"{path}: the file holds no tensors")
    return out, "; ".join(notes)


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        return False
    return True


def _read_safetensors(path: str) -> dict[str, Any]:
    import tempfile  # pylint: disable=import-outside-toplevel

    from safetensors import SafetensorError, safe_open  # pylint: disable=import-outside-toplevel

    def tensors(local: str) -> dict[str, Any]:
        with safe_open(local, framework="np") as f:  # (safetensors.numpy.load has no bfloat16)
            return {k: f.get_tensor(k) for k in f.keys()}
    try:
        if "://" not in str(path):
            return tensors(os.fspath(path))
        with tempfile.NamedTemporaryFile(suffix=".safetensors") as tmp:  # gs://: a local copy
            tmp.write(epath.Path(path).read_bytes())
            tmp.flush()
            return tensors(tmp.name)
    except (SafetensorError, OSError, TypeError) as e:  # TypeError: a dtype numpy lacks (FP8)
        raise CheckpointError(f"{path}: not a readable .safetensors file (truncated or corrupt "
                              f"download?): {e}") from None


def _read_torch(path: str) -> dict[str, Any]:
    import pickle  # pylint: disable=import-outside-toplevel

    import torch  # pylint: disable=import-outside-toplevel
    try:
        obj = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch names the first class it refused
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path}: holds Python objects besides tensors{what}, which torch.load("
            "weights_only=True) refuses; save the weights alone: torch.save(ckpt['model'], "
            "'FILE.pth') or safetensors.torch.save_file(ckpt['model'], 'FILE.safetensors')") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable PyTorch file (truncated or corrupt "
                              f"download?): {type(e).__name__}: {str(e).strip().split('. ')[0]}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    return obj


def _to_numpy(v: Any, path: str, key: str) -> tuple[np.ndarray, bool]:
    """The array (floating -> float32) and whether it was 16-bit (bfloat16/float16: exact)."""
    if hasattr(v, "detach"):  # a torch tensor: numpy has no bfloat16 view of it, widen first
        import torch  # pylint: disable=import-outside-toplevel
        t = v.detach().cpu()
        if not t.is_floating_point():
            return t.numpy(), False
        return t.to(torch.float32).numpy(), t.element_size() < 4
    if isinstance(v, (int, float)):
        v = np.asarray(v)
    if not isinstance(v, np.ndarray):
        raise CheckpointError(f"{path}: entry {key!r} is a {type(v).__name__}, not a tensor")
    if v.dtype == ml_dtypes.bfloat16 or v.dtype.kind == "f":  # ml_dtypes' bfloat16 has kind 'V'
        return v.astype(np.float32), v.dtype.itemsize < 4
    if v.dtype.kind not in "iub":
        raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {v.dtype}")
    return v, False
