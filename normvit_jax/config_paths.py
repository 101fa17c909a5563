"""Command-line overrides that ml_collections' config flag cannot express, applied after it parsed
the rest (main.py):

- a key inside a dict-valued field, by its path, whether or not the config already has it:
  ``--config.model.norm_overrides.block_1.name=rmsnorm`` (adds the override of block 1),
  ``--config.model.norm.groups=8`` (a norm option the config file did not set);
- ``None`` for any existing value: ``--config.model.variant=None`` unsets a preset's variant
  (the config flag would store the string 'None'); config_ranges.check refuses it where it has no
  meaning (``log_every``). A group of keys takes None only where it is dict-valued
  (``model.norm``: the default norm; ``model.norm_overrides``: none).
"""
from __future__ import annotations

import ast
import difflib
from typing import Any, Sequence

import ml_collections

PREFIX = "--config."
DICT_VALUED = ("model.norm", "model.norm_overrides")  # their keys are free (norm options, blocks)


def _paths(node: Any, prefix: str = "") -> list[str]:
    """Every key of a config by its dotted path, groups and values alike."""
    out = []
    for k in node.keys():
        out.append(prefix + k)
        if isinstance(node[k], ml_collections.ConfigDict):
            out += _paths(node[k], f"{prefix}{k}.")
    return out


def _initials(name: str) -> str:
    return "".join(w[:1] for w in name.split("_"))


def closest(config: Any, path: str, n: int = 3) -> list[str]:
    """The keys of ``config`` a misspelt or misplaced ``path`` most likely meant, best first:
    the same name in another group (``learning_rate`` -> ``optimizer.learning_rate``), a close
    spelling (``model.detph`` -> ``model.depth``), the initials of a name (``optimizer.lr`` ->
    ``optimizer.learning_rate``), or a name it begins (``mixup`` -> ``mixup_alpha``); a key of
    the same group before one of another."""
    group, _, leaf = path.rpartition(".")
    ranked = []
    for p in _paths(config):
        where, _, name = p.rpartition(".")
        similarity = difflib.SequenceMatcher(None, name, leaf).ratio()
        if name == leaf:
            tier = 0
        elif similarity >= 0.75:
            tier = 1
        elif "_" in name and _initials(name) == leaf:
            tier = 2
        elif len(leaf) >= 3 and name.startswith(leaf):
            tier = 3
        else:
            continue
        if p != path:
            ranked.append((tier, where != group, -similarity, p))
    return [p for *_, p in sorted(ranked)[:n]]


def did_you_mean(config: Any, path: str) -> str:
    """' (did you mean --config.X?)' naming ``closest``'s guesses, else ''."""
    guesses = closest(config, path)
    if not guesses:
        return ""
    return " (did you mean " + " or ".join(f"--config.{g}" for g in guesses) + "?)"


def _path_value(arg: str) -> tuple[str, str] | None:
    if not arg.startswith(PREFIX) or "=" not in arg:
        return None
    path, value = arg[len(PREFIX):].split("=", 1)
    return path, value


def _ours(path: str, value: str) -> bool:
    return value == "None" or any(path.startswith(d + ".") for d in DICT_VALUED)


def split(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """(argv for the config flag, the (path, text) overrides applied by ``apply`` afterwards)."""
    rest, ours = [], []
    for arg in argv:
        pv = _path_value(arg)
        if pv is not None and _ours(*pv):
            ours.append(pv)
        else:
            rest.append(arg)
    return rest, ours


def _parse(text: str, current: Any) -> Any:
    """The text as the type of the value it replaces; for a new key a Python literal (int,
    float, bool) or else the string itself."""
    if text == "None":
        return None
    if isinstance(current, bool) or text in ("True", "False", "true", "false"):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{text!r} is not a bool (True or False)")
        return text.lower() == "true"
    if isinstance(current, (int, float)):
        return type(current)(float(text) if isinstance(current, float) else int(text))
    if isinstance(current, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, (int, float)) else text


def _free(path: str) -> bool:
    """True for a key inside a dict-valued field: it may be created."""
    return any(path.startswith(d + ".") for d in DICT_VALUED)


def apply(config: ml_collections.ConfigDict, overrides: Sequence[tuple[str, str]]) -> None:
    """Applies ``split``'s overrides in order; raises ValueError naming a key that cannot be set."""
    for path, text in overrides:
        parts = path.split(".")
        node = config
        with config.unlocked():
            for i, part in enumerate(parts):
                here = ".".join(parts[:i + 1])
                if not isinstance(node, ml_collections.ConfigDict):
                    raise ValueError(f"--config.{path}: config.{'.'.join(parts[:i])} is a value, "
                                     "not a group of keys")
                if part not in node and not _free(here):
                    where = ".".join(["config"] + parts[:i])
                    raise ValueError(f"unknown config key --config.{path}: {where} has no key "
                                     f"{part!r}{did_you_mean(config, path)}; accepted: "
                                     f"{sorted(node.keys())}")
                if i < len(parts) - 1:
                    if part not in node:
                        node[part] = ml_collections.ConfigDict()
                    node = node[part]
                    continue
                current = node.get(part)
                # None for model.norm / norm_overrides: the default norm, no overrides
                if isinstance(current, ml_collections.ConfigDict) and (
                        text != "None" or path not in DICT_VALUED):
                    raise ValueError(f"--config.{path}={text}: config.{path} is a group of "
                                     f"keys, not a value; set one of {sorted(current.keys())}")
                try:
                    node[part] = _parse(text, current)
                except (ValueError, TypeError) as e:  # TypeError: a typed None (placeholder)
                    raise ValueError(f"--config.{path}={text}: {e}") from None
