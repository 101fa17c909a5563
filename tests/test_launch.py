"""Launching on many processes: when the distributed runtime is joined (normvit_jax/distributed.py)
and what the launch scripts run (their --dry-run, with stand-in gcloud/srun/sbatch on PATH)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from normvit_jax import cli, distributed
from tests.conftest import REPO_ROOT

SRUN_STEP = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5",
             "SLURM_LOCALID": "5", "SLURM_STEP_NODELIST": "gpu[001-002]", "SLURM_NTASKS": "16",
             "SLURM_STEP_NUM_TASKS": "16"}


@pytest.fixture
def warnings(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(distributed.logging, "warning", lambda msg, *a: seen.append(msg % a))
    return seen


def test_single_process_by_default(warnings):
    assert distributed.plan({}) is None and not warnings


def test_slurm_ntasks_outside_slurm_runs_alone(warnings):
    """Used to fail with 'coordinator_address should be defined'."""
    assert distributed.plan({"SLURM_NTASKS": "4"}) is None
    assert len(warnings) == 1 and "outside SLURM" in warnings[0] and "srun" in warnings[0]


def test_slurm_allocation_without_srun_runs_alone(warnings):
    """sbatch's script (or salloc's shell) has SLURM_NTASKS of the allocation but is one process:
    it used to wait minutes for peers that were never started."""
    env = {"SLURM_JOB_ID": "1234", "SLURM_NTASKS": "16", "SLURM_JOB_NODELIST": "gpu[001-002]"}
    assert distributed.plan(env) is None
    assert len(warnings) == 1 and "not started by srun" in warnings[0]
    assert "inside a SLURM allocation" in warnings[0]


def test_srun_step_with_several_tasks_joins(warnings):
    p = distributed.plan(SRUN_STEP)
    assert (p.source, p.num_processes, p.process_id, p.kwargs) == ("slurm", 16, 5, {})
    assert not warnings
    one_task = {**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    assert distributed.plan(one_task) is None


def test_explicit_coordinator_and_tpu_pod():
    p = distributed.plan({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
                          "JAX_PROCESS_ID": "2"})
    assert p.kwargs == {"num_processes": 4, "process_id": 2} and p.coordinator == "10.0.0.1:1234"
    assert distributed.plan({"JAX_COORDINATOR_ADDRESS": "h:1"}).kwargs == {}  # JAX reads the rest
    p = distributed.plan({"TPU_WORKER_HOSTNAMES": "a,b,c,d", "TPU_WORKER_ID": "3"})
    assert (p.source, p.num_processes, p.process_id) == ("tpu", 4, 3)
    assert distributed.plan({"TPU_WORKER_HOSTNAMES": "a"}) is None


def test_timeout_setting():
    assert distributed.timeout_s({}) == 300
    assert distributed.timeout_s({distributed.TIMEOUT_ENV: "20"}) == 20
    for bad in ("0", "-3", "ten"):
        with pytest.raises(ValueError, match=distributed.TIMEOUT_ENV):
            distributed.timeout_s({distributed.TIMEOUT_ENV: bad})


def test_failure_names_the_missing_processes():
    p = distributed.plan(SRUN_STEP)
    listed = distributed.describe_failure(p, 30, RuntimeError(
        "DEADLINE_EXCEEDED: tasks not connected: /job:jax_worker/replica:0/task:3, "
        "/job:jax_worker/replica:0/task:7"))
    assert "missing: processes 3, 7" in listed and "within 30 s" in listed and "srun" in listed
    coordinator = distributed.Plan("env", 3, 0, "h:1", {})
    assert "missing: processes 1, 2 (some or all" in distributed.describe_failure(
        coordinator, 5, TimeoutError())
    assert "missing: process 0 (the coordinator) and/or processes 2" in distributed.describe_failure(
        distributed.Plan("env", 3, 1, "h:1", {}), 5, TimeoutError())


def test_rendezvous_times_out_with_exit_code_and_message(tmp_path):
    """A real rendezvous with a peer that never comes: a message and EXIT_DISTRIBUTED after the
    timeout, instead of a silent wait (or XLA's abort with a C++ stack trace)."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, distributed.TIMEOUT_ENV: "2",
           "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    t0 = time.time()
    r = subprocess.run([sys.executable, "main.py", "--config=configs/vit_ln.py:demo",
                        f"--workdir={tmp_path}/wd"], cwd=REPO_ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == cli.EXIT_DISTRIBUTED == distributed.EXIT_CODE, r.stderr[-3000:]
    assert "did not all join within 2 s at 127.0.0.1:1" in r.stderr
    assert "missing: process 0 (the coordinator)" in r.stderr
    assert "Check failure stack trace" not in r.stderr
    assert time.time() - t0 < 60
    assert not (tmp_path / "wd").exists()
