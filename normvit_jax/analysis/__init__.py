"""Analysis of trained runs: attention maps and distances, token statistics, norm gates, training
curves and a comparison report. Reads checkpoints, ``config.json`` and the TensorBoard summaries of a
workdir, never the training loop's internals.

    python -m normvit_jax.analysis.attention --workdir=runs/dtn --images=8 --out=report/dtn
    python -m normvit_jax.analysis.report runs/ln runs/dtn runs/un --out=report/

``eval_hook.EvalAnalyzer`` is the hook the loop builds once and calls at eval time (token statistics, gates, attention
distances and, if ``config.eval_attention_images > 0``, attention-map images).
"""
