"""Which runs of a report are seeds of one method and which are other recipes of it.

``colors.method_of`` keys a run by its normalization alone, so LN runs at two learning rates were
averaged as seeds of one method. Here the runs of one such method pool as seeds only when their
config.json files (flattened, 'optimizer.learning_rate') agree on every compared key: every key
but the seed and ``NOT_COMPARED``. Runs of one normalization that differ in compared keys are
separate methods, keyed ``<method>[<key>=<value>,...]`` with the keys that differ among that
normalization's runs in the report (``colors.label``: 'LN [lr=0.001]').

NOT_COMPARED: the keys configs/default.py documents as changing neither what is trained nor the
numbers evaluated at a step: logging and checkpoint cadence, where the same state is placed (the
mesh, CPU threads), how the input is fed (prefetch, decode threads, decoding once into memory:
"the same batches, bit for bit"), implementations and memory trade-offs of the same model
(attention_impl, fusion_barriers, recompute, stream_layout, scan, remat, and a norm's
``run_config.IMPLEMENTATION_NORM_OPTIONS``: saved_input, kernel, ...), the eval batch size (the
last batch is padded and masked), the eval-time analysis images, and data_dir (where the same
dataset lies). ``eval_every`` IS compared: it sets the steps whose top-1 the convergence table
compares (steps to the target are known to that resolution only), so pooling runs evaluated at
other steps would average reaching steps measured at different resolutions.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Mapping, Sequence

from normvit_jax import run_config

SEED_KEYS = ("seed",)
NOT_COMPARED = (
    "log_every", "checkpoint_every", "keep_checkpoints", "allow_config_change",
    "mesh.data", "mesh.fsdp", "mesh.fsdp_min_size", "reproducible_cpu_threads",
    "data.data_dir", "data.prefetch", "data.num_workers", "data.in_memory_mb", "data.return_index",
    "model.attention_impl", "model.fusion_barriers", "model.recompute", "model.stream_layout",
    "model.scan", "remat", "eval_batch_size", "eval_analysis_images", "eval_attention_images",
)
ABSENT = "<absent>"  # a key one run's config.json has and another's (of a newer version) lacks


def compared(key: str) -> bool:
    """Whether runs that differ in ``key`` are different recipes (not seeds of one)."""
    return (key not in SEED_KEYS and key not in NOT_COMPARED and not key.startswith("mesh.")
            and not run_config.is_norm_implementation_key(key))


@functools.lru_cache(maxsize=1)
def _defaults() -> dict:
    return run_config.default_values()


def flat(saved: Mapping[str, Any]) -> dict:
    """A config.json's values by dotted key; a key of configs/default.py it lacks (an older run)
    at its default, as resuming treats it (run_config.config_diff)."""
    return {**_defaults(), **run_config.flatten(dict(saved))}


def _canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def value_text(v: Any) -> str:
    """A value as the method key writes it: strings bare, the rest as JSON (0.001, true, null)."""
    return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))


def _differing(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    keys = sorted({k for c in configs for k in c})
    return [k for k in keys if len({_canon(c.get(k, ABSENT)) for c in configs}) > 1]


@dataclasses.dataclass
class Recipes:
    method: dict[str, str]        # workdir -> its method key (with the recipe part)
    recipe: dict[str, dict]       # workdir -> {key: value} of the keys that split its method
    between: list[str]            # compared keys that differ only between methods (the norm)
    within: list[str]             # compared keys that differ among one method's runs: recipes
    seeds: list[str]              # seed keys that differ (pooled)
    ignored: list[str]            # NOT_COMPARED keys that differ (pooled)

    def line(self) -> str:
        """report.md's line: which config keys differ between the runs and how each is read."""
        parts = [f"{what}: {', '.join(keys)}" for what, keys in (
            ("between methods", _grouped(self.between)),
            ("recipes of one method (separate rows)", self.within),
            ("seeds (pooled)", self.seeds),
            ("not compared (they change neither what is trained nor how it is evaluated)",
             self.ignored)) if keys]
        return ("- Config keys that differ between the runs: "
                + ("; ".join(parts) if parts else "none") + ".\n")


# Prefixes whose keys together are one part of a method: seventeen norms' runs differ in some
# fifty model.norm.* options, which listed one by one buried the keys that matter.
_GROUPED = ("model.norm.", "model.norm_overrides.", "model.stem_norm.")


def _grouped(keys: Sequence[str]) -> list[str]:
    """``keys`` with two or more under one of _GROUPED as one entry: 'model.norm.* (47 keys)'."""
    counts = {p: sum(k.startswith(p) for k in keys) for p in _GROUPED}
    out: list[str] = []
    for k in keys:
        p = next((p for p in _GROUPED if k.startswith(p) and counts[p] > 1), None)
        entry = k if p is None else f"{p}* ({counts[p]} keys)"
        if entry not in out:
            out.append(entry)
    return out


def split(runs: Sequence[tuple[str, str, Mapping[str, Any]]]) -> Recipes:
    """runs: (workdir, ``colors.method_of`` key, config.json as a dict) of each run. Each run's
    method key gets '[k=v,...]' with the compared keys that differ among the runs of its method
    (none where they all agree: the plain key, as before)."""
    configs = {w: flat(c) for w, _, c in runs}
    groups: dict[str, list[str]] = {}
    for w, m, _ in runs:
        groups.setdefault(m, []).append(w)
    method, recipe, within = {}, {}, set()
    for m, ws in groups.items():
        keys = [k for k in _differing([configs[w] for w in ws]) if compared(k)]
        within.update(keys)
        for w in ws:
            recipe[w] = {k: configs[w].get(k, ABSENT) for k in keys}
            method[w] = m + ("[" + ",".join(f"{k}={value_text(v)}" for k, v in recipe[w].items())
                             + "]" if keys else "")
    every = _differing(list(configs.values()))
    return Recipes(method, recipe,
                   between=[k for k in every if compared(k) and k not in within],
                   within=sorted(within),
                   seeds=[k for k in every if k in SEED_KEYS],
                   ignored=[k for k in every if k not in SEED_KEYS and not compared(k)])


def base_of(method: str) -> str:
    """The method key without its recipe part: 'layernorm[optimizer.learning_rate=0.001]' ->
    'layernorm'."""
    return method.partition("[")[0]
