"""Puts the repository root on sys.path so tests import ``configs`` and ``benchmarks``."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
