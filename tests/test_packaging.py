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


def _ceiling(spec: str) -> tuple[int, ...] | None:
    m = re.search(r"<\s*(\d+)\.(\d+)", spec)
    return (int(m.group(1)), int(m.group(2))) if m else None


# The newest Python each tensorflow-cpu series publishes wheels for (checked on PyPI 2026-11-28:
# 2.21.0 has cp313 wheels and installs on 3.13; no 2.20/2.21 wheel is cp314, only 2.22.0rc0 is).
TF_CPU_NEWEST_PYTHON = {(2, 20): (3, 13), (2, 21): (3, 13)}


def test_python_ceiling_is_the_one_the_tensorflow_pin_allows():
    """requires-python has an upper bound, below the first Python the pinned tensorflow-cpu has no
    wheels for: a user on Python 3.14 gets pip's "requires a different Python" at once, not "No
    matching distribution found for tensorflow-cpu". Widening the TF pin to a series with newer
    wheels (add it to the table) is what may raise the ceiling, after a fresh install there."""
    project = _project()
    ceiling = _ceiling(project["requires-python"])
    assert ceiling is not None, f"requires-python without an upper bound: {project['requires-python']}"
    tf = next(r for r in project["dependencies"] if r.startswith("tensorflow-cpu"))
    tf_floor, tf_ceiling = _floor(tf), _ceiling(tf)
    series = [(2, minor) for minor in range(tf_floor[1], tf_ceiling[1])]
    unknown = [s for s in series if s not in TF_CPU_NEWEST_PYTHON]
    assert not unknown, f"tensorflow-cpu series {unknown}: add the newest Python they have wheels for"
    newest = max(TF_CPU_NEWEST_PYTHON[s] for s in series)  # pip picks a series with wheels
    assert ceiling == (newest[0], newest[1] + 1), (project["requires-python"], tf, newest)


def test_readme_names_the_supported_pythons_as_pyproject_does():
    """The README's install paragraph quotes requires-python as pyproject.toml has it."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    spec = _project()["requires-python"]
    assert f'`requires-python = "{spec}"`' in readme, spec
