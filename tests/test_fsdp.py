"""Sharded parameters and optimizer state (config.mesh.fsdp; normvit_jax/sharding.py).

The rule and the mesh shape are checked here directly; training and checkpoints run once in a
subprocess with 8 CPU devices (tests/fsdp_script.py) whose measurements the tests below assert on:
fsdp=1 is bit-identical to the pre-FSDP replicated path, fsdp=4 trains as data=4 does (LayerNorm and
the cross-device-statistics norms), and a checkpoint saved on 8 devices restores on 4 and on 1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from configs import default
from normvit_jax import sharding
from tests.deploy_runs import XLA_FAST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NORMS = ("layernorm", "batchnorm", "powernorm", "unified")
# Error of the fsdp=4 parameters relative to the size of the 3-step update (float32 sums in
# another order): observed <= 1e-6 on CPU; 1e-4 leaves room for other XLA versions.
UPDATE_TOL = 1e-4
STATS_TOL = 1e-5  # batch_stats: max|a - b| / max|b|


def test_fsdp_rule():
    assert sharding.fsdp_spec((768, 3072), 8) == P(None, "fsdp")       # the largest axis
    assert sharding.fsdp_spec((3072, 768), 8) == P("fsdp")
    assert sharding.fsdp_spec((768, 12, 64), 8) == P("fsdp")           # attention q/k/v kernel
    assert sharding.fsdp_spec((12, 768, 3072), 8) == P(None, None, "fsdp")  # scanned stack
    assert sharding.fsdp_spec((64, 64), 4, min_size=0) == P(None, "fsdp")  # ties: the last axis
    assert sharding.fsdp_spec((1000, 10), 8, min_size=0) == P("fsdp")
    assert sharding.fsdp_spec((10, 10), 4, min_size=0) == P()          # nothing divisible
    assert sharding.fsdp_spec((768,), 8) == P()                        # under fsdp_min_size
    assert sharding.fsdp_spec((), 8, min_size=0) == P()                # scalars (step)
    assert sharding.fsdp_spec((768, 3072), 1) == P()                   # fsdp=1: replicated


def test_fsdp_split_is_said_in_numbers():
    """--config.mesh.fsdp=2 on the demo split nothing (its largest array, 8192 elements, is below
    fsdp_min_size) and the start said only 'mesh data=4 x fsdp=2'."""
    import numpy as np
    params = {"a": np.zeros((64, 128), np.float32), "b": np.zeros((128,), np.float32),
              "c": np.zeros((3, 5), np.float32)}
    assert sharding.describe_fsdp(params, 1) is None  # nothing to say: replicated on purpose
    assert sharding.describe_fsdp(params, 2) == (
        "fsdp=2 splits 0 of 3 parameter arrays (none has >= fsdp_min_size=16384 elements)")
    assert sharding.describe_fsdp(params, 2, min_size=100) == (
        "fsdp=2 splits 2 of 3 parameter arrays (33,280 of 33,340 bytes; those with >= "
        "fsdp_min_size=100 elements and an axis divisible by 2)")
    assert sharding.describe_fsdp(params, 7, min_size=100).startswith(
        "fsdp=7 splits 0 of 3 parameter arrays (none of the 2 with >= fsdp_min_size=100 elements "
        "has an axis divisible by 7)")


def test_mesh_shape_and_config_defaults():
    c = default.get_config()
    assert (c.mesh.data, c.mesh.fsdp) == (-1, 1)  # today's behaviour: plain data parallelism
    assert c.mesh.fsdp_min_size == sharding.FSDP_MIN_SIZE == sharding.fsdp_min_size(c)
    assert sharding.mesh_shape(8) == (8, 1)
    assert sharding.mesh_shape(8, fsdp=4) == (2, 4)
    assert sharding.mesh_shape(8, data=2, fsdp=-1) == (2, 4)
    for data, fsdp in ((-1, 3), (3, 2), (-1, -1), (0, 1)):
        with pytest.raises(ValueError, match="config.mesh"):
            sharding.mesh_shape(8, data, fsdp)
    with pytest.raises(ValueError, match=r"got data=-1, fsdp=3; accepted: divisors of 8 \[1, 2, "
                                         r"4, 8\]"):  # it said data=0, a value nobody set
        sharding.mesh_shape(8, -1, 3)
    mesh = sharding.make_mesh(c)
    assert mesh.axis_names == ("data", "fsdp") and mesh.shape["fsdp"] == 1


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    # XLA's backend optimizations off (as tests/deploy_runs.py): the ~20 compiles on 8 devices
    # are this fixture's time; every comparison is between programs compiled alike.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 " + XLA_FAST,
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fsdp_script.py"),
                        str(tmp_path_factory.mktemp("fsdp") / "ckpt")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fsdp1_is_bit_identical_to_replicated(measured):
    assert measured["mesh_fsdp1"] == {"data": 8, "fsdp": 1}
    for norm in ("layernorm", "batchnorm"):
        assert measured[f"replicated_{norm}"], norm
        assert measured[f"identical_{norm}"], norm


def test_fsdp4_trains_as_data4(measured):
    for norm in NORMS:
        # every array with an axis divisible by 4 is split (fsdp_min_size=0 in the script)
        assert measured[f"sharded_fraction_{norm}"] > 0.99, norm
        assert measured[f"update_err_fsdp4_{norm}"] <= UPDATE_TOL, (norm, measured)
        assert measured[f"stats_err_fsdp4_{norm}"] <= STATS_TOL, (norm, measured)
    assert measured["update_err_data2_fsdp4_layernorm"] <= UPDATE_TOL, measured
    assert measured["mesh_data2_fsdp4"] == {"data": 2, "fsdp": 4}
    assert measured["mlp_kernel"] == {"shape": [32, 64], "spec": "P(None, 'fsdp')",
                                      "shard": [32, 16]}


@pytest.mark.parametrize("target", ["4dev_fsdp4", "4dev_data2_fsdp2", "1dev"])
def test_checkpoint_restores_onto_another_mesh(measured, target):
    assert measured[f"restore_{target}_equal"], target       # every array, bit for bit
    assert measured[f"restore_{target}_shardings"], target   # in the target mesh's shardings
    assert measured[f"restore_{target}_devices"] == (1 if target == "1dev" else 4)


def test_mesh_keys_may_change_on_resume_and_are_validated():
    """Resuming with another mesh is no config change (checkpoints restore onto any mesh); a
    mesh that does not fit the device count is refused before anything is built."""
    from normvit_jax import run_config
    from normvit_jax.train import setup
    from tests.conftest import tiny_demo_config
    saved = tiny_demo_config()
    current = tiny_demo_config(**{"mesh.fsdp": 8, "mesh.data": 2, "mesh.fsdp_min_size": 0})
    assert run_config.config_diff(saved.to_dict(), current.to_dict()) == []
    assert run_config.config_diff(saved.to_dict(), tiny_demo_config(seed=1).to_dict()) != []
    with pytest.raises(ValueError, match="config.mesh.data x config.mesh.fsdp"):
        setup.validate_config(tiny_demo_config(**{"mesh.fsdp": 3}), num_devices=8)
    setup.validate_config(tiny_demo_config(**{"mesh.fsdp": 4}), num_devices=8)


def test_fsdp_benchmark_runs():
    """benchmarks/fsdp.py end to end on this process's devices (one: both rows replicated)."""
    from benchmarks import fsdp
    res = fsdp.main(["--models=Ti/4", "--depth=1", "--image_size=8", "--num_classes=10",
                     "--step_model="])
    rows = res["rows"]
    assert [r["fsdp"] for r in rows] == [1, 1] and rows[0]["params_M"] > 0
    assert rows[0]["peak_GiB"] >= rows[0]["arguments_GiB"] > 0
