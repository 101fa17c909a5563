"""When to join JAX's distributed runtime, and a rendezvous that ends with a message instead of
hanging.

Several processes are assumed only when something started several: JAX_COORDINATOR_ADDRESS
(set by hand), a SLURM job step with more than one task (``srun`` sets SLURM_STEP_ID and
SLURM_STEP_NUM_TASKS; a batch script alone only has SLURM_NTASKS of the allocation), a TPU pod
on GKE (TPU_WORKER_HOSTNAMES lists several workers), or a Cloud TPU VM (launch/tpu_pod.sh): its
shell has none of these; JAX reads the slice's workers from the VM's metadata server. The rendezvous waits at most
NORMVIT_DISTRIBUTED_TIMEOUT seconds (default 300), then names the processes that did not join.
Once joined, the start's checks end in ``agree``: a check that fails on some processes only (a
dataset missing on one host, the workdir lock held on process 0) stops every process at once
with that reason and exit code, instead of leaving the others in the next collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import socket
import sys
import threading
import time
from typing import Any, Mapping

from absl import logging

TIMEOUT_ENV = "NORMVIT_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 300
EXIT_CODE = 7  # cli.EXIT_DISTRIBUTED


class DistributedStartError(RuntimeError):
    """The processes of a multi-process run did not all meet (cli: EXIT_DISTRIBUTED)."""


class PeerStoppedError(RuntimeError):
    """Another process of the run stopped at start (``agree``); this one stops with it and with
    its exit code (``code``; cli.exit_code returns it)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


MESSAGE_BYTES = 1024  # of a failed process's message that the others repeat


@dataclasses.dataclass(frozen=True)
class Plan:
    """How this process joins: ``kwargs`` go to ``jax.distributed.initialize``."""

    source: str                     # 'env' (JAX_COORDINATOR_ADDRESS) | 'slurm' | 'tpu'
    num_processes: int | None       # None: JAX finds out (TPU)
    process_id: int | None
    coordinator: str | None         # None: JAX finds out (SLURM: first node of the step; TPU)
    kwargs: dict[str, Any]


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key, "").strip()
    return int(value) if value.lstrip("-").isdigit() else None


def on_cloud_tpu_vm() -> bool:
    """True on a Cloud TPU VM (libtpu installed, TPU chips attached): what ``import jax`` found."""
    import jax  # noqa: F401  (its import runs cloud_tpu_init, which sets the flag)
    from jax._src import cloud_tpu_init
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def plan(env: Mapping[str, str] | None = None, tpu_vm: bool | None = None) -> Plan | None:
    """The way this process joins the others, or None when it runs alone (with a warning when
    the environment suggests several processes but nothing started them). ``tpu_vm``: whether
    this is a Cloud TPU VM (default: ``on_cloud_tpu_vm()``)."""
    env = os.environ if env is None else env
    if env.get("JAX_COORDINATOR_ADDRESS"):
        n, pid = _count_and_id(env)
        kwargs = {"num_processes": n, "process_id": pid} if n is not None and pid is not None else {}
        return Plan("env", n, pid, env["JAX_COORDINATOR_ADDRESS"], kwargs)
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
    in_step = all(env.get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID",
                                       "SLURM_LOCALID", "SLURM_STEP_NODELIST"))
    if in_step and ntasks and ntasks > 1:
        return Plan("slurm", ntasks, _int(env, "SLURM_PROCID"), None, {})
    if (_int(env, "SLURM_NTASKS") or 1) > 1 and not in_step:
        where = ("inside a SLURM allocation" if env.get("SLURM_JOB_ID")
                 else "outside SLURM (SLURM_JOB_ID is unset)")
        logging.warning(
            "SLURM_NTASKS=%s but this process was not started by srun (%s: no SLURM_STEP_ID): "
            "running as ONE process. For %s processes start it with `srun python main.py ...` "
            "(launch/slurm_gpu.sbatch).", env.get("SLURM_NTASKS"), where, env.get("SLURM_NTASKS"))
    if env.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0:
        return Plan("tpu", env["TPU_WORKER_HOSTNAMES"].count(",") + 1, _int(env, "TPU_WORKER_ID"),
                    None, {})
    if "TPU_WORKER_HOSTNAMES" not in env and (on_cloud_tpu_vm() if tpu_vm is None else tpu_vm):
        # a pod slice's workers are in the metadata, not the environment: libtpu joins them
        # without jax.distributed, but then no SIGTERM reached JAX's preemption sync point (a
        # Spot preemption killed the run without a checkpoint) and every host logged. On one
        # host JAX's detection finds one process.
        return Plan("tpu", None, None, None, {})
    return None


def _count_and_id(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """JAX_NUM_PROCESSES and JAX_PROCESS_ID beside JAX_COORDINATOR_ADDRESS: both, or neither
    (JAX finds them out, e.g. from a cluster's environment). One without the other, a value that
    is not a whole number or an id not below the count raise DistributedStartError naming the
    variable, before JAX starts (JAX said only 'Number of processes must be defined')."""
    raw = {k: env.get(k, "").strip() for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    fix = ("set JAX_NUM_PROCESSES (the number of processes) and JAX_PROCESS_ID (0 to "
           "JAX_NUM_PROCESSES-1, distinct per process) for every process, beside "
           f"JAX_COORDINATOR_ADDRESS={env.get('JAX_COORDINATOR_ADDRESS')}")
    if not any(raw.values()):
        return None, None
    for key, value in raw.items():
        if not value:
            other = next(k for k in raw if k != key)
            raise DistributedStartError(f"{key} is unset ({other}={value or raw[other]} is set): "
                                        f"{fix}.")
        if not value.isdigit():
            raise DistributedStartError(f"{key}={value!r} is not a whole number >= 0: {fix}.")
    n, pid = int(raw["JAX_NUM_PROCESSES"]), int(raw["JAX_PROCESS_ID"])
    if n < 1 or pid >= n:
        raise DistributedStartError(
            f"JAX_PROCESS_ID={pid} is not below JAX_NUM_PROCESSES={n}: {fix}." if n >= 1 else
            f"JAX_NUM_PROCESSES=0 is not a process count: {fix}.")
    return n, pid


def check_local_devices(devices: list[Any]) -> None:
    """Every process of the run must have as many devices as every other (the mesh, the batch
    split and ``agree``'s all-gather assume it): from the global device list, which every process
    sees alike, so all of them stop together without a collective. Raises DistributedStartError
    naming each process's count."""
    counts: dict[int, int] = {}
    for d in devices:
        counts[int(d.process_index)] = counts.get(int(d.process_index), 0) + 1
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"process {i}: {n}" for i, n in sorted(counts.items()))
        raise DistributedStartError(
            f"the {len(counts)} processes have different numbers of local devices: {listed}; "
            "every process needs the same count (the same XLA_FLAGS "
            "--xla_force_host_platform_device_count, CUDA_VISIBLE_DEVICES or GPUs per task)")


def timeout_s(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    raw = env.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a whole number of seconds >= 1")
    return int(raw)


def describe_failure(p: Plan, timeout: int, error: BaseException) -> str:
    """Names who did not join: the task ids in the coordination service's error where it lists
    them, else every other process (this one cannot see which of them are missing)."""
    text = str(error)
    missing = sorted({int(t) for t in re.findall(r"task:(\d+)", text)} - {p.process_id})
    if not missing and p.num_processes:
        missing = [i for i in range(p.num_processes) if i != p.process_id]
        others = [i for i in missing if i != 0]
        who = (f"processes {_ranges(missing)} (some or all of them)" if p.process_id == 0
               and len(missing) > 1 else f"process {missing[0]}" if p.process_id == 0 else
               "process 0 (the coordinator)" + (f" and/or processes {_ranges(others)}" if others else ""))
    else:
        who = f"processes {_ranges(missing)}" if missing else "the other processes"
    at = p.coordinator or {"slurm": "the first node of the SLURM step", "tpu": "TPU worker 0"}.get(
        p.source, "the coordinator")
    hint = {"slurm": "start every task with srun (one per GPU, launch/slurm_gpu.sbatch) and check "
                     "that no task failed to start",
            "tpu": "run the same command on every worker (launch/tpu_pod.sh)",
            "env": "start every process with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES "
                   "and a distinct JAX_PROCESS_ID"}[p.source]
    first_line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return (f"process {p.process_id if p.process_id is not None else '?'} of "
            f"{p.num_processes or '?'} ({p.source}): the other processes did not all join within "
            f"{timeout} s at {at}; missing: {who}. {hint[0].upper()}{hint[1:]}; "
            f"{TIMEOUT_ENV} sets the wait. ({type(error).__name__}: {first_line[:300]})")


def describe_refusal(p: Plan, waited: float, error: BaseException) -> str:
    """An error of ``jax.distributed.initialize`` itself before the wait was over (the process
    count unset or a port in use are caught before, see plan and coordinator_port_taken; a bad
    address): JAX's reason, not a claim that
    the others did not come."""
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else type(error).__name__
    hint = {"slurm": "start every task with srun (launch/slurm_gpu.sbatch)",
            "tpu": "run the same command on every worker (launch/tpu_pod.sh)",
            "env": "set JAX_COORDINATOR_ADDRESS=host:port (a free port on process 0's host), "
                   "JAX_NUM_PROCESSES and a distinct JAX_PROCESS_ID for every process"}[p.source]
    return (f"process {p.process_id if p.process_id is not None else '?'} of "
            f"{p.num_processes or '?'} ({p.source}): jax.distributed.initialize failed after "
            f"{waited:.0f} s, before any wait for the others was over: {type(error).__name__}: "
            f"{first_line[:300].rstrip('.')}. {hint[0].upper()}{hint[1:]}.")


def coordinator_port_taken(p: Plan) -> str | None:
    """Process 0 of an explicit coordinator address checks that the port is free before JAX
    binds it: with the port in use JAX's coordination service sometimes segfaults (about 1 start
    in 4 here) instead of raising. Returns why the port cannot be used, or None (also when it
    cannot be checked here, e.g. no permission to bind it: JAX's own error then stands). SLURM and
    TPU starts choose their coordinator inside JAX and are not checked."""
    if p.source != "env" or p.process_id != 0 or not p.coordinator:
        return None
    host, sep, port = p.coordinator.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host.strip("[]")
    # JAX's service listens on every interface at that port; SO_REUSEADDR ignores TIME_WAIT
    # leftovers of an earlier run, as the service itself does, but not a live listener.
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((address, int(port)))
            return None
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (f"port {port} of the coordinator address {host}:{port} is in use on this "
                        "host (another run's coordinator?); choose a free port")
            continue  # no IPv6 here, or a privileged port: try IPv4, else leave it to JAX
    return None


def _ranges(ids: list[int]) -> str:
    if len(ids) > 8:
        return f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else str(ids)
    return ", ".join(map(str, ids))


def initialize(env: Mapping[str, str] | None = None) -> Plan | None:
    """Joins the others (or does nothing alone). After the timeout the process stops with
    EXIT_CODE and a message: XLA's client would abort the process with a C++ stack trace (a few
    seconds after its own deadline), so a watchdog thread ends it first."""
    p = plan(env)
    if p is None:
        return None
    timeout = timeout_s(env)
    taken = coordinator_port_taken(p)
    if taken:
        raise DistributedStartError(f"process 0 of {p.num_processes or '?'} ({p.source}): "
                                    f"cannot start the coordinator: {taken}.")
    import jax
    logging.info("Joining %s processes (%s) within %d s.", p.num_processes or "the", p.source, timeout)
    watchdog = threading.Timer(timeout, _give_up, args=(p, timeout))
    watchdog.daemon = True
    watchdog.start()
    t0 = time.monotonic()
    try:
        # XLA's own deadline comes later, so the message above wins the race
        jax.distributed.initialize(initialization_timeout=timeout + 60, **p.kwargs)
    except Exception as e:  # noqa: BLE001  (XLA raises JaxRuntimeError/RuntimeError/ValueError)
        waited = time.monotonic() - t0
        raise DistributedStartError(
            describe_failure(p, timeout, e) if waited >= timeout else
            describe_refusal(p, waited, e)) from e
    finally:
        watchdog.cancel()
    check_local_devices(jax.devices())
    return p


def agree(stage: str, error: Exception | None) -> None:
    """Every process calls this at the end of ``stage`` with the error that stopped it there
    (None: none). Alone: raises ``error`` if any. With several processes they first exchange
    (exit code, first line of the message) in one all-gather, which is also the barrier that ends
    the stage; if any failed, a failed process raises its own error and every other one
    ``PeerStoppedError`` with the exit code and message of the lowest-numbered failed process.
    Without this a process that stopped alone left the others waiting in the next collective
    until XLA's timeout ended them with a traceback (exit 1), the reason in another log."""
    import jax
    if jax.process_count() == 1:
        if error is not None:
            raise error
        return
    import numpy as np
    from jax.experimental import multihost_utils

    from normvit_jax import cli
    record = np.zeros(1 + MESSAGE_BYTES, np.int32)  # [exit code (0: none), message bytes...]
    if error is not None:
        code = cli.exit_code(error)
        text = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if code is None:  # a bug: its traceback is in that process's log
            code, text = 1, f"{type(error).__name__}: {text} (a bug: its traceback is in its log)"
        raw = text.encode()[:MESSAGE_BYTES]
        record[0], record[1:1 + len(raw)] = code, np.frombuffer(raw, np.uint8)
    records = np.asarray(multihost_utils.process_allgather(record))  # (processes, 1 + bytes)
    failed = [i for i in range(len(records)) if records[i, 0]]
    if error is not None:
        raise error
    if failed:
        i = failed[0]
        text = bytes(records[i, 1:].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
        code = int(records[i, 0])
        raise PeerStoppedError(f"process {i} of {len(records)} stopped during {stage} (exit {code}"
                               f"), so every process stops: {text}", code)


def check_shared_workdir(workdir: str, wait_s: float = 10.0) -> None:
    """Several processes, a local workdir: process 0 writes a probe file with a token of its own
    into ``workdir`` and every other process must read that token there (within ``wait_s``: a
    network filesystem may show a new file late); else every process stops (``agree``) with a
    WorkdirError naming the first process that does not see it. A workdir on each node's own
    disk used to train: Orbax's non-primary processes then waited for a checkpoint folder that
    only process 0's disk had, silently, until its timeout, and no checkpoint was ever complete."""
    import jax
    from normvit_jax import workdir as workdir_lib
    if jax.process_count() == 1 or workdir_lib.is_remote(workdir):
        return
    import numpy as np
    from jax.experimental import multihost_utils
    token = np.frombuffer(os.urandom(16), np.uint8)
    token = np.asarray(multihost_utils.broadcast_one_to_all(token)).astype(np.uint8).tobytes().hex()
    path = os.path.join(workdir, f".shared_probe.{token}")
    me, error = jax.process_index(), None
    try:
        if me == 0:
            with open(path, "w") as f:
                f.write(token)
    except OSError as e:
        error = workdir_lib.WorkdirError(f"cannot write {path}: {e}")
    agree("writing a probe into the workdir", error)  # written before anyone looks
    try:
        deadline = time.monotonic() + wait_s
        while me > 0 and not _reads(path, token):
            if time.monotonic() > deadline:
                error = workdir_lib.WorkdirError(
                    f"process {me} does not see the workdir {workdir} that process 0 writes (on "
                    f"host {socket.gethostname()}: no {os.path.basename(path)} after "
                    f"{wait_s:.0f} s): every process must use one folder they all see, on a "
                    "shared filesystem or gs://, not a disk of its own node")
                break
            time.sleep(0.2)
        agree("checking that every process sees the workdir", error)
    finally:
        if me == 0:
            with contextlib.suppress(OSError):
                os.remove(path)


def _reads(path: str, token: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == token
    except OSError:
        return False


def _give_up(p: Plan, timeout: int) -> None:
    message = describe_failure(p, timeout, TimeoutError("no rendezvous"))
    logging.error("Stopped: %s", message)
    logging.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)
