"""Run by tests/test_fsdp.py in a subprocess with 8 CPU devices (the XLA flag must be set before
JAX starts, and must not touch other test modules). Prints one JSON line of measurements that the
test asserts on: ``python tests/fsdp_script.py <tmpdir>``."""
from __future__ import annotations

import json
import sys

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from normvit_jax import checkpoints, data, sharding
from normvit_jax.train import optimizer, setup
from tests.conftest import tiny_demo_config

IMAGE = (8, 8, 3)
STEPS = 3
NORMS = {  # warmups of 2 steps so the 3rd step runs the stateful norms' post-warmup path
    "layernorm": {"name": "layernorm"},
    "batchnorm": {"name": "batchnorm"},
    "powernorm": {"name": "powernorm", "warmup": 2},
    "unified": {"name": "unified", "warmup": 2, "window": 2, "ratio_warmup": 2},
}


def config(norm: str, data: int, fsdp: int, opt: str = "adamw") -> ml_collections.ConfigDict:
    # One block: every kind of array (embedding, attention, MLP, norms, head) is in it, and each
    # compile here takes ~40% less time than with the demo's two.
    c = tiny_demo_config(**{"model.depth": 1})
    c.optimizer.name = opt
    if opt == "sgd":  # a step size that moves the parameters as far as adamw's
        c.optimizer.learning_rate = 0.3
    c.model.norm = ml_collections.ConfigDict(NORMS[norm])
    c.mesh.data, c.mesh.fsdp, c.mesh.fsdp_min_size = data, fsdp, 0  # tiny arrays sharded too
    return c


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"image": rng.normal(size=(32,) + IMAGE).astype(np.float32),
             "label": rng.integers(0, 10, 32).astype(np.int32)} for _ in range(STEPS)]


def parts(c: ml_collections.ConfigDict):
    model = setup.create_model(c, 10)
    tx, lr = optimizer.create(c, 10)
    return model, tx, setup.make_train_step(c, model, tx, lr, data.resolve_data_spec(c))


def train(c: ml_collections.ConfigDict, devices: list, initial: list | None = None
          ) -> tuple[object, object]:
    """(state after STEPS steps, the mesh) through the loop's own setup functions; ``initial``,
    if given, receives the initial params as host arrays (before the donating steps)."""
    model, tx, fn = parts(c)
    mesh = sharding.make_mesh(c, devices=devices)
    state, ss = setup.create_train_state(model, tx, IMAGE, mesh, jax.random.key(0),
                                         sharding.fsdp_min_size(c))
    if initial is not None:
        initial.append(jax.tree.map(np.asarray, state.params))
    step = setup.jit_train_step(fn, ss, mesh)
    for b in batches():
        state, _ = step(state, sharding.to_global(b, mesh))
    return state, mesh


def train_before_fsdp(c: ml_collections.ConfigDict, devices: list):
    """Today's (pre-FSDP) path written out: a 1-D 'data' mesh, everything replicated."""
    model, tx, fn = parts(c)
    mesh = Mesh(np.asarray(devices), ("data",))
    rep, bat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    state = jax.jit(setup.state_init(model, tx, IMAGE), out_shardings=rep)(jax.random.key(0))
    step = jax.jit(fn, in_shardings=(rep, bat), out_shardings=(rep, rep), donate_argnums=0)
    for b in batches():
        state, _ = step(state, {k: jax.make_array_from_process_local_data(bat, v)
                                for k, v in b.items()})
    return state


def leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def update_err(a, b, p0) -> float:
    """||a - b|| / ||b - p0|| over all parameters: the error relative to the size of the update
    that ``STEPS`` steps made from the initial parameters ``p0``."""
    return float(np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b) - flat(p0)))


def stats_err(a, b) -> float:
    """Largest max|a - b| / max|b| over the float arrays of batch_stats (0 if there are none)."""
    out = 0.0
    for x, y in zip(leaves(a), leaves(b)):
        if np.issubdtype(x.dtype, np.floating) and x.size:
            x, y = x.astype(np.float64), y.astype(np.float64)
            out = max(out, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
    return out


def sharded_fraction(state) -> float:
    """Fraction of the params' elements whose arrays are split over 'fsdp'."""
    ps = jax.tree.leaves(state.params)
    split = sum(x.size for x in ps if sharding.FSDP_AXIS in jax.tree.leaves(tuple(x.sharding.spec)))
    return split / sum(x.size for x in ps)


def main(tmp: str) -> None:
    devs = jax.devices()
    assert len(devs) == 8, devs
    out: dict = {}

    # 1. fsdp=1 is today's behaviour, bit for bit (8 devices, data=8).
    for norm in ("layernorm", "batchnorm"):
        new, mesh = train(config(norm, -1, 1), devs)
        old = train_before_fsdp(config(norm, -1, 1), devs)
        out[f"identical_{norm}"] = all(np.array_equal(x, y) for x, y in zip(leaves(new), leaves(old)))
        out[f"replicated_{norm}"] = all(s.spec == P() for s in jax.tree.leaves(
            jax.tree.map(lambda x: x.sharding, new)))
        out["mesh_fsdp1"] = dict(mesh.shape)

    # 2. fsdp=4 (data=1) on 4 devices vs data=4 (fsdp=1) on 4 devices; data=2 x fsdp=4 on 8 too.
    # SGD here: Adam divides each coordinate by its own gradient RMS, so a coordinate whose true
    # gradient is 0 (the attention key bias: softmax is shift invariant) gets an lr-sized step of
    # random sign from rounding noise, under any two reduction orders, FSDP or not.
    for norm in NORMS:
        init: list = []  # the initial params of the data=4 run (no extra compile)
        ref, _ = train(config(norm, 4, 1, "sgd"), devs[:4], init)
        fs, mesh = train(config(norm, 1, 4, "sgd"), devs[:4])
        p0 = init[0]
        out[f"update_err_fsdp4_{norm}"] = update_err(fs.params, ref.params, p0)
        out[f"stats_err_fsdp4_{norm}"] = stats_err(fs.batch_stats, ref.batch_stats)
        out[f"sharded_fraction_{norm}"] = sharded_fraction(fs)
        if norm == "layernorm":
            both, mesh8 = train(config(norm, 2, 4, "sgd"), devs)
            out["update_err_data2_fsdp4_layernorm"] = update_err(both.params, ref.params, p0)
            out["mesh_data2_fsdp4"] = dict(mesh8.shape)
            k = both.params["Transformer"]["encoderblock_0"]["MlpBlock_3"]["Dense_0"]["kernel"]
            out["mlp_kernel"] = {"shape": list(k.shape), "spec": str(k.sharding.spec),
                                 "shard": list(k.addressable_shards[0].data.shape)}

    # 3. Checkpoint saved on 8 devices (data=2 x fsdp=4), restored on 4 (fsdp=4; data=2 x fsdp=2)
    # and on 1 device, each into the target mesh's shardings.
    saved, _ = train(config("layernorm", 2, 4), devs)  # adamw: its moments are sharded too
    mngr = checkpoints.make_manager(tmp, async_save=False)
    checkpoints.save(mngr, STEPS, saved, {"note": "fsdp"})
    mngr.wait_until_finished()
    model, tx, _ = parts(config("layernorm", 2, 4))
    for name, data_axis, fsdp, n in (("4dev_fsdp4", 1, 4, 4), ("4dev_data2_fsdp2", 2, 2, 4),
                                     ("1dev", 1, 1, 1)):
        c = config("layernorm", data_axis, fsdp)
        mesh = sharding.make_mesh(c, devices=devs[:n])
        abstract, ss = setup.abstract_train_state(model, tx, IMAGE, mesh, sharding.fsdp_min_size(c))
        restored = checkpoints.restore_latest(mngr, abstract)
        got = restored.state
        out[f"restore_{name}_equal"] = all(np.array_equal(x, y)
                                           for x, y in zip(leaves(got), leaves(saved)))
        out[f"restore_{name}_shardings"] = all(
            x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(got),
                                                                   jax.tree.leaves(ss)))
        out[f"restore_{name}_devices"] = len(jax.tree.leaves(got.params)[0].sharding.device_set)
    mngr.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
