"""Eval-time summaries for the training loop: token statistics, norm gates, attention distances
and (if ``config.eval_attention_images > 0``) attention-map images, from one jitted capture
forward on a small fixed batch. Training steps never capture.

    analyzer = eval_hook.EvalAnalyzer(model, config, data_spec)      # once, before the loop
    images = eval_hook.fixed_images(config, data_spec, 16)
    scalars, pictures = analyzer(variables, images)             # at each eval (compiled once)
    writer.write_scalars(step, scalars); writer.write_images(step, pictures)

Scalar tags: 'tokens/<slot>/<in|out>/<stat>' (slot e.g. 'encoderblock_0/LayerNorm_0',
'encoder_norm'; stat in chan_mean, chan_var, tok_mean, tok_var, max_abs),
'gates/<slot>/<gate>' (see ``gates``), 'attention_distance/encoderblock_<b>/head<h>' and
'.../mean' in pixels. Image tag: 'attention/maps', uint8 (N, H, W, 3), one figure per image
(rows: blocks 0/3/6/9-style, columns: the input and up to 4 heads).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np

from normvit_jax.analysis import attention, capture, colors, figures, gates, plots_attention

Summaries = tuple[dict[str, float], dict[str, np.ndarray]]


def fixed_images(config: Any, data_spec: Any, n: int = 16) -> np.ndarray:
    """The first n eval images (model inputs): the fixed batch to pass at every eval."""
    return capture.eval_images(config, data_spec, n)[0]


def scalars_of(a: capture.Analysis, norm_gates: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    out = {f"tokens/{slot}/{side}/{k}": v for slot, sides in a.stats.items()
           for side, d in sides.items() for k, v in d.items()}
    out.update({f"gates/{k}": v for k, v in gates.flat(norm_gates).items()})
    dist = a.distance.mean(1)  # (depth, H), mean over images
    for b, row in enumerate(dist):
        out[f"attention_distance/encoderblock_{b}/mean"] = float(row.mean())
        out.update({f"attention_distance/encoderblock_{b}/head{h}": float(v) for h, v in enumerate(row)})
    return out


def render_maps(a: capture.Analysis, display: np.ndarray, method: str) -> np.ndarray:
    """uint8 (N, H, W, 3): per image, rows = default blocks, columns = input + up to 4 heads."""
    depth, heads = len(a.cls_maps), a.cls_maps[0].shape[1]
    blocks, hs = attention.default_blocks(depth), list(range(min(heads, 4)))
    out = []
    for i, img in enumerate(display):
        fig = plots_attention.overlay_grid(
            [img] * len(blocks), [[a.cls_maps[b][i, h] for h in hs] for b in blocks],
            [f"block {b}" + ("" if a.has_cls[b] else "*") for b in blocks], [f"head {h}" for h in hs],
            f"{colors.label(method)}: attention maps, eval image {i}")
        out.append(figures.to_uint8(fig))
    return np.stack(out)


class EvalAnalyzer:
    """The loop's hook, built once per run: the jitted capture forward of ``model`` (compiled at
    the first call, reused at every eval).

    ``analyzer(variables, images, sharding=None)``: ``variables`` = {'params': ...,
    'batch_stats': ...} of the train state, ``images`` a small fixed batch of eval inputs
    (``fixed_images``), placed with ``sharding`` (the mesh's replicated sharding: every process
    passes the same images, as multi-process jit wants global arrays). Returns (scalars, images)
    ready for ``write_scalars``/``write_images``; images is empty unless
    ``config.eval_attention_images > 0`` (read at each call).
    """

    def __init__(self, model: Any, config: Any, data_spec: Any):
        self.config, self.data_spec = config, data_spec
        self.spec = model.spec
        grid, p = capture.geometry(self.spec, data_spec.image_shape[0])
        self.forward: Callable = capture.make_analyzer(model, grid, p, full=False)

    def __call__(self, variables: Mapping, images: np.ndarray, sharding: Any = None) -> Summaries:
        config = self.config
        variables = {k: v for k, v in variables.items() if k in ("params", "batch_stats") and v}
        inputs = images if sharding is None else jax.make_array_from_callback(
            images.shape, sharding, lambda index: images[index])
        a = capture.to_analysis(self.forward(variables, inputs), self.spec.block_has_cls())
        pictures = {}
        n_maps = int(config.eval_attention_images)
        if n_maps > 0:
            shown = capture.display_images(np.asarray(images[:n_maps]), self.data_spec)
            pictures["attention/maps"] = render_maps(a, shown, colors.method_of(config))
        return scalars_of(a, gates.norm_gates(variables)), pictures
