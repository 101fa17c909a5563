"""Result files written whole or not at all (no JAX import: the parent tools use it too)."""
from __future__ import annotations

import os


def write_text_atomic(path: str, text: str) -> None:
    """``text`` into a temporary file beside ``path``, then renamed over it: a reader, or a Ctrl-C
    mid-write, finds the previous complete file or the new one, never a truncated one (these
    tools rewrite README.md and docs/*.md in place)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
