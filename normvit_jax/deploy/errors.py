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


class DynamicBatchError(DeployError):
    """The format's runtime cannot read what the converter writes for a dynamic batch (a fixed
    ``--batch`` can still be exported)."""


class MissingExtraError(DeployError):
    """A package of the ``deploy`` extra is not installed."""


def require(module: str, what: str) -> object:
    """Imports ``module`` or raises MissingExtraError naming the extra that installs it
    (``what``: the format or command that needs it)."""
    if module == "tensorflow":  # its two C++ libraries would each print the start-up lines
        from normvit_jax import logs
        logs.import_tensorflow_once()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{what} needs the package {module.split('.')[0]!r} ({e}); install the deploy "
            "extra: pip install -e '.[deploy]'") from None
