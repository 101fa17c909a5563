"""A trained (or folded) model as a self-contained artifact that runs without this project.

    python -m normvit_jax.export --workdir=W --format=onnx|savedmodel|stablehlo --out=PATH \
        [--fold] [--batch=N] [--folded=DIR] [--step=S]

``bundle``: the one place a run is read (checkpoint, config, class names) and the serving
function every format converts (uint8 ``image`` -> ``probabilities``, ``logits``);
``onnx_format``, ``savedmodel_format``, ``stablehlo_format``: one converter each;
``artifact``: the files written beside every artifact and how a reader finds them;
``export_artifact``: the command's entry. The contract is in docs/deploy.md.
"""
from normvit_jax.deploy.artifact import FORMATS, export_artifact, read_metadata
from normvit_jax.deploy.errors import DeployError, MissingExtraError, UnsupportedOpError

__all__ = ["FORMATS", "DeployError", "MissingExtraError", "UnsupportedOpError", "export_artifact",
           "read_metadata"]
