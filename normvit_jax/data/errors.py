"""Errors the data package raises on purpose, so main.py can print them without a traceback."""
from __future__ import annotations


class DatasetNotFoundError(ValueError):
    """A tfds dataset is not prepared (or not in a readable format) in the data dir looked in."""
