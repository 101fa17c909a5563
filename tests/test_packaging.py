"""pyproject.toml pins tested ranges: a fresh install today and next month resolve to the same
major APIs (every requirement bounded above, or pinned), and the Python floor is the one the
pinned jax/flax floors need."""
from __future__ import annotations

import os
import re

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11, which the project needs anyway

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _requirements(project: dict) -> list[str]:
    extras = [r for group in project["optional-dependencies"].values() for r in group]
    return project["dependencies"] + [r for r in extras if not r.startswith(project["name"])]


def test_every_requirement_has_an_upper_bound_or_a_pin():
    reqs = _requirements(_project())
    assert len(reqs) > 20
    unbounded = [r for r in reqs if not re.search(r"(<|==|~=)", r)]
    assert not unbounded, f"requirements without an upper bound: {unbounded}"


def _floor(spec: str | None) -> tuple[int, ...]:
    m = re.search(r">=\s*(\d+)\.(\d+)", spec or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


CI_PYTHON = (3, 11)  # .ci/run's Python: pip resolves the pins' oldest series there


def test_python_floor_is_what_the_installed_dependencies_need():
    """requires-python is not below the Requires-Python of any installed main dependency (jax
    0.10, flax 0.12, numpy 2.4 declare >= 3.11): a user on an older Python is told by pip at once,
    not by a resolver failure on jax. On a newer Python pip installs newer releases whose floors
    are higher (flax 0.12.12 and jax 0.11 need 3.12), which say nothing of the project's floor."""
    import sys
    from importlib import metadata
    if sys.version_info[:2] != CI_PYTHON:
        pytest.skip(f"checked on Python {CI_PYTHON[0]}.{CI_PYTHON[1]}, where the oldest pins install")
    project = _project()
    floors = {}
    for req in project["dependencies"]:
        name = re.split(r"[\[<>=!~ ]", req, maxsplit=1)[0]
        try:
            floors[name] = _floor(metadata.metadata(name).get("Requires-Python"))
        except metadata.PackageNotFoundError:
            continue
    assert len(floors) > 10 and floors["jax"] >= (3, 11), floors
    ours = _floor(project["requires-python"])
    assert ours >= max(floors.values()), (project["requires-python"], floors)
