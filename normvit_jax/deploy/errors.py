"""The errors of an export that the command prints as one line and exits 2 on."""
from __future__ import annotations

import importlib


class DeployError(Exception):
    """Bad input to an export: the message is the one line the command prints."""


class UnsupportedOpError(DeployError):
    """The model uses an operation the format (its converter) cannot express."""

    def __init__(self, op: str, fmt: str, detail: str = "") -> None:
        self.op, self.fmt = op, fmt
        tail = f" ({detail})" if detail and detail != op else ""
        super().__init__(f"--format={fmt} cannot express the operation {op!r} of this model"
                         f"{tail}; try another format (onnx, savedmodel, stablehlo)")


class ConverterError(DeployError):
    """The format's converter itself failed on the model (an exception raised inside it, not a
    primitive it reports as unsupported): named by the converter's module where it raised, with
    the way out (a fixed ``--batch`` where the batch was dynamic; another format)."""

    def __init__(self, fmt: str, where: str, error: BaseException, dynamic_batch: bool) -> None:
        self.fmt, self.where = fmt, where
        text = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        others = ", ".join(f for f in ("onnx", "savedmodel", "stablehlo") if f != fmt)
        way_out = (f"export a fixed batch with --batch=N, or try another format ({others})"
                   if dynamic_batch else f"try another format ({others})")
        super().__init__(f"--format={fmt}: the converter failed on this model"
                         f"{' with a dynamic batch' if dynamic_batch else ''} in {where} ({text}); "
                         f"{way_out}; NORMVIT_TRACEBACK=1 shows the traceback")


class DynamicBatchError(DeployError):
    """The format's runtime cannot read what the converter writes for a dynamic batch (a fixed
    ``--batch`` can still be exported)."""


class MissingExtraError(DeployError):
    """A package of the ``deploy`` extra is not installed."""


# An import's name -> the pip distribution that installs it, where they differ.
DISTRIBUTIONS = {"multipart": "python-multipart", "python_multipart": "python-multipart"}
# Main dependencies (pyproject's dependencies, not the deploy extra's).
MAIN_DEPENDENCIES = {"tensorflow", "jax", "jaxlib", "numpy"}


def require(module: str, what: str) -> object:
    """Imports ``module`` or raises MissingExtraError naming the import that failed (``module``
    itself, or a package it imports: jax2onnx imports onnx and onnxruntime), the pip
    distribution that installs it (``python-multipart`` for ``multipart``) and the extra
    (``what``: the format or command that needs it)."""
    if module == "tensorflow":  # its two C++ libraries would each print the start-up lines
        from normvit_jax import logs
        logs.import_tensorflow_once()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        failed = (getattr(e, "name", None) or top).split(".")[0]
        dist = DISTRIBUTIONS.get(failed, failed)
        via = "" if failed == top else f", which {top} imports"
        fix = ("reinstall the project: pip install -e ." if dist in MAIN_DEPENDENCIES
               else "install the deploy extra: pip install -e '.[deploy]'")
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise MissingExtraError(
            f"{what} needs the package {dist!r} (import {failed!r} failed{via}: {detail}); "
            f"{fix}") from None
