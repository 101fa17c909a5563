"""Reads PyTorch state dicts (timm, DeiT) as flat name -> numpy arrays, for ``config.init_from``.

``.safetensors`` is read with the ``safetensors`` package (no torch); ``.pth``/``.pt``/``.bin``
need torch and are read with ``torch.load(weights_only=True)``, which refuses pickled code.
Floating tensors come back as float32 (bfloat16/float16 widen exactly). What the arrays mean is
``models.timm_layout``'s business.
"""
from __future__ import annotations

import io
import os
import re
import struct
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
# Floating dtypes read (widened to float32 where narrower): FP8 and quantized tensors carry scales
# elsewhere in the file (or in the code), so their raw values are not the weights: refused.
FLOATS = ("F16", "BF16", "F32", "F64")
EMA_KEYS = ("model_ema", "state_dict_ema", "ema")
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
        tilde = " (a '~' is not expanded here: give the full path)" if str(path).startswith("~") else ""
        raise CheckpointError(f"{key}={path!r} does not exist{tilde}")
    if p.is_dir():
        raise CheckpointError(f"{key}={path!r} is a directory, not a state dict file (give the "
                              "file in it, e.g. DIR/model.safetensors)")
    try:
        with p.open("rb") as f:
            head = f.read(16)
    except OSError as e:
        raise CheckpointError(f"{key}={path!r} cannot be read ({type(e).__name__}: {e})") from None
    if not head:
        raise CheckpointError(f"{key}={path!r} is an empty file (an interrupted download?)")
    if str(path).lower().endswith(TORCH) and not is_safetensors(head) and not _has_torch():
        raise CheckpointError(f"{key}: " + NO_TORCH.format(path=path))


def is_safetensors(head: bytes) -> bool:
    """Whether a file's first bytes are a safetensors header (a little-endian u64 length, then
    '{'), whatever its suffix: a .bin the HF hub or a user saved with safetensors reads as one."""
    return len(head) > 8 and 1 < struct.unpack("<Q", head[:8])[0] < 10**9 and head[8:9] == b"{"


def read(path: str) -> tuple[dict[str, np.ndarray], str]:
    """(flat name -> array, a note on what was unwrapped/widened) of a state dict file."""
    check(path)
    with epath.Path(path).open("rb") as f:
        head = f.read(16)
    if str(path).lower().endswith(SAFETENSORS) or is_safetensors(head):
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
        ema = [k for k in nested if k in EMA_KEYS]
        hint = (f"; an EMA copy ({ema[0]}) is never taken silently: to start from it, save it alone "
                f"(torch.save(ckpt[{ema[0]!r}], 'FILE.pth'))" if ema else "")
        raise CheckpointError(f"{path}: a dict of dicts ({', '.join(nested)}), not a state dict; "
                              f"the weights are read from one of {list(WRAPPERS)}{hint}")
    ddp = [k for k in raw if k.startswith("module.")]
    if raw and len(ddp) == len(raw):  # saved from DistributedDataParallel
        raw = {k[len("module."):]: v for k, v in raw.items()}
        notes.append("'module.' prefix removed")
    elif ddp:  # two models' keys merged, or a hand-edited file: which name is meant is unclear
        plain = next(k for k in raw if not k.startswith("module."))
        raise CheckpointError(f"{path}: {len(ddp)} of {len(raw)} keys have the 'module.' prefix "
                              f"(DistributedDataParallel; e.g. {ddp[0]}), the others not (e.g. "
                              f"{plain}): save one model's state dict")
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
            fmt = (f.metadata() or {}).get("format", "pt")
            if fmt in ("tf", "flax", "jax", "mlx"):  # transformers' other frameworks: other layouts
                raise CheckpointError(f"{path}: saved from {fmt} (metadata format={fmt!r}): its names "
                                      "and kernel layouts are not PyTorch's; use the PyTorch weights "
                                      "(the hub's model.safetensors / pytorch_model.bin)")
            for k in f.keys():
                dtype = f.get_slice(k).get_dtype()
                if dtype.startswith("F") and dtype not in FLOATS:
                    raise CheckpointError(_low_precision(path, k, dtype))
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
        # a remote file (gs://) is read through etils.epath: torch.load opens local paths only
        src = (io.BytesIO(epath.Path(path).read_bytes()) if "://" in str(path) else os.fspath(path))
        obj = torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch names the first class it refused
        what = f" ({found.group(1)})" if found else ""
        if found and _is_module_class(found.group(1)):  # torch.save(model): a module, no dict
            raise CheckpointError(
                f"{path}: holds Python objects besides tensors{what}, which torch.load("
                "weights_only=True) refuses; it is a whole pickled model (torch.save(model)): save "
                f"its weights alone: torch.save(torch.load({str(path)!r}, weights_only=False)"
                ".state_dict(), 'FILE.pth')") from None
        raise CheckpointError(
            f"{path}: holds Python objects besides tensors{what}, which torch.load("
            "weights_only=True) refuses; save the weights alone: torch.save(ckpt['model'], "
            "'FILE.pth') or safetensors.torch.save_file(ckpt['model'], 'FILE.safetensors')") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        if _is_npz(path):
            raise CheckpointError(f"{path}: an .npz archive (numpy arrays), not a PyTorch file: name "
                                  "it FILE.npz to load it as Google's layouts") from None
        raise CheckpointError(f"{path}: not a readable PyTorch file (truncated or corrupt "
                              f"download?): {type(e).__name__}: {str(e).strip().split('. ')[0]}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    return obj


def _is_module_class(name: str) -> bool:
    """Whether the class torch refused is a model (``torch.save(model)`` pickles the module first):
    torch's own modules, timm's models, or a class of the saving script (``__main__``)."""
    return name.startswith(("torch.nn.modules.", "timm.models.", "timm.layers.", "__main__."))


def _is_npz(path: str) -> bool:
    """Whether ``path`` is a zip of .npy arrays (np.savez), which torch.load cannot read."""
    import zipfile  # pylint: disable=import-outside-toplevel
    try:
        with epath.Path(path).open("rb") as f, zipfile.ZipFile(f) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
    return bool(names) and all(n.endswith(".npy") for n in names)


def _to_numpy(v: Any, path: str, key: str) -> tuple[np.ndarray, bool]:
    """The array (floating -> float32) and whether it was 16-bit (bfloat16/float16: exact)."""
    if hasattr(v, "detach"):  # a torch tensor: numpy has no bfloat16 view of it, widen first
        import torch  # pylint: disable=import-outside-toplevel
        t = v.detach().cpu()
        if t.is_quantized or (t.is_floating_point() and t.dtype not in (
                torch.float16, torch.bfloat16, torch.float32, torch.float64)):
            raise CheckpointError(_low_precision(path, key, str(t.dtype).replace("torch.", "")))
        if t.layout != torch.strided:  # sparse: the same values, densified
            t = t.to_dense()
        if not t.is_floating_point():
            if t.is_complex():
                raise CheckpointError(f"{path}: tensor {key!r} is complex ({t.dtype}), not a weight")
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


def _low_precision(path: str, key: str, dtype: str) -> str:
    return (f"{path}: tensor {key!r} is {dtype} (FP8 or quantized: its scales live elsewhere, so "
            "the raw values are not the weights); save the model in float32, bfloat16 or float16")
