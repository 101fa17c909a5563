"""Launching on many processes: when the distributed runtime is joined (normvit_jax/distributed.py)
and what the launch scripts run (their --dry-run, with stand-in gcloud/srun/sbatch on PATH)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from normvit_jax import cli, distributed
from tests.conftest import REPO_ROOT, environ_without_xla_flags

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


def test_cloud_tpu_vm_joins_through_jax_detection(warnings):
    """A Cloud TPU VM's shell (launch/tpu_pod.sh) has no TPU_WORKER_HOSTNAMES: JAX finds the
    slice's workers in the VM's metadata. It used to run without jax.distributed (libtpu joins
    the hosts anyway), so a Spot preemption's SIGTERM never reached the preemption sync point
    and killed the run without a checkpoint."""
    p = distributed.plan({}, tpu_vm=True)
    assert (p.source, p.num_processes, p.process_id, p.kwargs) == ("tpu", None, None, {})
    assert distributed.plan({}, tpu_vm=False) is None
    assert distributed.plan({"TPU_WORKER_HOSTNAMES": "a"}, tpu_vm=True) is None  # GKE, one host
    assert distributed.on_cloud_tpu_vm() is False and distributed.plan({}) is None  # not here
    assert not warnings


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


def test_a_refused_start_is_said_as_such_not_as_missing_peers():
    """jax.distributed.initialize failing at once (a coordinator port in use and a process count
    or id unset are caught before JAX: the tests below) used to be reported as 'the other
    processes did not all join within 60 s', naming them missing, with JAX's reason only at the
    end in parentheses."""
    p = distributed.Plan("env", 2, 1, "127.0.0.1:1", {"num_processes": 2, "process_id": 1})
    line = distributed.describe_refusal(p, 0.4, ValueError("coordinator_address is bad.\nmore"))
    assert "did not all join" not in line and "missing" not in line
    assert line.startswith("process 1 of 2 (env): jax.distributed.initialize failed after 0 s, "
                           "before any wait for the others was over: ValueError: coordinator_"
                           "address is bad. Set JAX_COORDINATOR_ADDRESS=host:port"), line


@pytest.mark.parametrize("unset, present", [("JAX_PROCESS_ID", {"JAX_NUM_PROCESSES": "2"}),
                                            ("JAX_NUM_PROCESSES", {"JAX_PROCESS_ID": "0"})])
def test_a_process_count_or_id_unset_is_named_before_jax_starts(tmp_path, unset, present):
    """JAX_COORDINATOR_ADDRESS with only one of JAX_NUM_PROCESSES / JAX_PROCESS_ID: the plan
    passed neither to JAX, whose 'ValueError: Number of processes must be defined.' (exit 7,
    'process ? of 2') did not say which variable was missing. Now one line names it, before JAX
    starts (exit 7: a start refused), and no workdir is left."""
    env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", **present}
    with pytest.raises(distributed.DistributedStartError) as e:
        distributed.plan(env)
    assert f"{unset} is unset" in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert cli.exit_code(e.value) == cli.EXIT_DISTRIBUTED
    with pytest.raises(distributed.DistributedStartError, match="JAX_PROCESS_ID='one' is not"):
        distributed.plan({**env, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "one"})
    with pytest.raises(distributed.DistributedStartError, match="JAX_PROCESS_ID=2 is not below"):
        distributed.plan({**env, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"})
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    run_env.update(PYTHONPATH=REPO_ROOT, **env)
    t0 = time.time()
    r = subprocess.run([sys.executable, "main.py", "--config=configs/vit_ln.py:demo",
                        f"--workdir={tmp_path}/wd"], cwd=REPO_ROOT, env=run_env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == cli.EXIT_DISTRIBUTED, r.stderr[-3000:]
    assert "jax.distributed.initialize" not in r.stderr and "Joining" not in r.stderr
    assert re.search(rf"Stopped: .*{unset} is unset", r.stderr), r.stderr[-3000:]
    assert time.time() - t0 < 60 and not (tmp_path / "wd").exists()


def test_processes_with_different_local_device_counts_stop_in_one_line(monkeypatch):
    """2 CPU devices in process 0 and 3 in process 1 (different XLA_FLAGS, or GPUs per node):
    both stopped with exit 2 and 'cannot reshape array of size 5 into shape (2,2)' from the
    first all-gather (distributed.agree). Now the start names each process's count (exit 7),
    checked from the global device list right after joining, before any collective."""
    class Dev:
        def __init__(self, i):
            self.process_index = i
    assert distributed.check_local_devices([Dev(0), Dev(0), Dev(1), Dev(1)]) is None
    with pytest.raises(distributed.DistributedStartError) as e:
        distributed.check_local_devices([Dev(0), Dev(0), Dev(1), Dev(1), Dev(1)])
    assert str(e.value).startswith("the 2 processes have different numbers of local devices: "
                                   "process 0: 2, process 1: 3;"), str(e.value)
    assert cli.exit_code(e.value) == cli.EXIT_DISTRIBUTED
    # initialize runs it once joined
    monkeypatch.setattr("jax.distributed.initialize", lambda **kw: None)
    monkeypatch.setattr("jax.devices", lambda: [Dev(0), Dev(1), Dev(1)])
    with pytest.raises(distributed.DistributedStartError, match="process 0: 1, process 1: 2"):
        distributed.initialize({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2",
                                "JAX_PROCESS_ID": "1"})


def test_two_real_processes_with_2_and_3_devices_both_exit_7(tmp_path):
    """The walker's command: two processes on this machine, 2 and 3 CPU devices."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    procs = [subprocess.Popen(
        [sys.executable, "main.py", "--config=configs/vit_ln.py:demo", f"--workdir={tmp_path}/wd",
         "--config.total_steps=20", "--config.batch_size=60"], cwd=REPO_ROOT,
        env={**base, "PYTHONPATH": REPO_ROOT, distributed.TIMEOUT_ENV: "60",
             "XLA_FLAGS": f"--xla_force_host_platform_device_count={2 + i}",
             "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
             "JAX_PROCESS_ID": str(i)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True) for i in range(2)]
    try:
        out = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, err in zip(procs, out):
        assert p.returncode == cli.EXIT_DISTRIBUTED, err[-3000:]
        assert ("Stopped: the 2 processes have different numbers of local devices: process 0: 2, "
                "process 1: 3;") in err and "reshape" not in err, err[-3000:]


def test_a_taken_coordinator_port_stops_process_0_in_one_line_before_jax(monkeypatch):
    """Process 0 with its coordinator port held by another listener: one line naming the port,
    before jax.distributed.initialize (which sometimes segfaults on a taken port). Another
    process id, or a free port, is left to JAX."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": "0"}
        called = []
        monkeypatch.setattr("jax.distributed.initialize", lambda **kw: called.append(kw))
        with pytest.raises(distributed.DistributedStartError) as e:
            distributed.initialize(env)
        assert not called
        assert str(e.value) == (f"process 0 of 2 (env): cannot start the coordinator: port {port} "
                                f"of the coordinator address 127.0.0.1:{port} is in use on this "
                                "host (another run's coordinator?); choose a free port.")
        assert distributed.coordinator_port_taken(
            distributed.plan({**env, "JAX_PROCESS_ID": "1"})) is None  # not the one that binds
    # the listener gone, the same port is free again (SO_REUSEADDR: TIME_WAIT does not count)
    assert distributed.coordinator_port_taken(distributed.plan(env)) is None
    assert cli.exit_code(distributed.DistributedStartError("x")) == cli.EXIT_DISTRIBUTED


# ------------------------------------------------------------------------- launch scripts

STUB = r"""#!/usr/bin/env bash
# Stand-in: records its name and arguments (NUL-separated, one file per call), then exits with
# $STUB_RC_<name> (default 0), or 3 when an argument contains $STUB_FAIL.
n=$(ls "$STUB_CALLS" | wc -l)
printf '%s\0' "$(basename "$0")" "$@" > "$STUB_CALLS/$(printf '%04d' "$n")"
name=$(basename "$0")
if [ -n "${STUB_FAIL:-}" ]; then for a in "$@"; do case "$a" in *"$STUB_FAIL"*) exit 3 ;; esac; done; fi
rc_var="STUB_RC_${name//-/_}"
exit "${!rc_var:-0}"
"""


@pytest.fixture
def stubs(tmp_path):
    """A PATH with stand-in gcloud, srun, sbatch, scontrol, git, pip and python (the real python
    stays reachable as sys.executable), and a reader of the calls they saw."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name in ("gcloud", "srun", "sbatch", "scontrol", "git", "pip", "python"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    env = {**environ_without_xla_flags(), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "STUB_CALLS": str(calls)}

    def seen() -> list[list[str]]:
        return [open(p, "rb").read().decode().split("\0")[:-1] for p in sorted(calls.iterdir())]

    return env, seen


def script(name: str, *args: str, env: dict, cwd: str = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.path.join(REPO_ROOT, "launch", name), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=60)


CONFIG = "configs/vit_ln.py:s16,cifar100"  # the comma used to split sbatch --export


@pytest.mark.parametrize("name", ["slurm_gpu.sbatch", "tpu_pod.sh", "sweep.sh", "local.sh"])
def test_help_runs_nothing(stubs, name):
    env, seen = stubs
    r = script(name, "--help", env=env)
    assert r.returncode == 0 and "--dry-run" in r.stdout, r.stderr
    assert seen() == []
    assert not os.path.exists(os.path.join(REPO_ROOT, "runs", "demo_--help"))


def test_slurm_script_gpus_and_arguments(stubs):
    env, seen = stubs
    text = open(os.path.join(REPO_ROOT, "launch", "slurm_gpu.sbatch")).read()
    assert "--gpus-per-task" not in text.replace("With --gpus-per-task", "")
    assert "#SBATCH --gres=gpu:8" in text and "#SBATCH --ntasks-per-node=8" in text
    r = script("slurm_gpu.sbatch", "--dry-run", CONFIG, "/shared/my runs/ln", "--config.batch_size=256",
               env=env)
    assert r.returncode == 0 and seen() == []
    assert r.stdout.splitlines()[0] == ("srun --kill-on-bad-exit=1 python main.py "
                                        r"--config=configs/vit_ln.py:s16\,cifar100 "
                                        r"--workdir=/shared/my\ runs/ln --config.batch_size=256 ")
    # as the job runs it: srun preempted (42) -> requeue, and the exit code passed on
    job = {**env, "SLURM_JOB_ID": "1234", "SLURM_SUBMIT_DIR": REPO_ROOT, "STUB_RC_srun": "42"}
    r = script("slurm_gpu.sbatch", CONFIG, "/shared/my runs/ln", "--config.batch_size=256", env=job)
    assert r.returncode == 42
    assert seen() == [["srun", "--kill-on-bad-exit=1", "python", "main.py", f"--config={CONFIG}",
                       "--workdir=/shared/my runs/ln", "--config.batch_size=256"],
                      ["scontrol", "requeue", "1234"]]


def test_slurm_requeued_job_continues_instead_of_starting_over(stubs):
    """Submitted with --fresh, the job is requeued with the same arguments after each preemption
    (exit 42): each restart moved the checkpoints aside and began at step 0 again. A requeued
    job (SLURM_RESTART_COUNT > 0) drops --fresh; the first start keeps it."""
    env, seen = stubs
    job = {**env, "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": REPO_ROOT}
    for restarts, want in (("0", ["--fresh"]), ("2", [])):
        before = len(seen())
        r = script("slurm_gpu.sbatch", CONFIG, "/shared/run", "--fresh", "--config.seed=1",
                   env={**job, "SLURM_RESTART_COUNT": restarts})
        assert r.returncode == 0, r.stderr
        (srun,) = seen()[before:]
        assert srun == ["srun", "--kill-on-bad-exit=1", "python", "main.py", f"--config={CONFIG}",
                        "--workdir=/shared/run", *want, "--config.seed=1"]


def test_slurm_script_needs_config_and_workdir(stubs):
    env, seen = stubs
    r = script("slurm_gpu.sbatch", env=env)
    assert r.returncode == 2 and "CONFIG and WORKDIR are required" in r.stderr and seen() == []


def test_tpu_script_runs_training_detached_on_every_worker(stubs, tmp_path):
    env, seen = stubs
    env = {**env, "TPU": "my-v4-32", "ZONE": "us-central2-b", "REPO": "https://example.org/n.git",
           "REF": "abc123"}
    args = (CONFIG, "gs://bucket/run", "--config.data.data_dir=gs://bucket/tfds")
    dry = script("tpu_pod.sh", "--dry-run", *args, env=env)
    assert dry.returncode == 0 and seen() == []
    assert dry.stdout.startswith("gcloud compute tpus tpu-vm ssh my-v4-32 --zone us-central2-b "
                                 "--worker=all --command ")
    r = script("tpu_pod.sh", *args, env=env)
    assert r.returncode == 0, r.stderr
    (gcloud,) = seen()
    assert gcloud[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v4-32", "--zone",
                          "us-central2-b"] and gcloud[8:10] == ["--worker=all", "--command"]
    remote = gcloud[10]
    assert "setsid nohup" in remote and "git clone -q https://example.org/n.git" in remote
    assert remote in dry.stdout  # the dry run printed the same script
    # run the worker's script here with stand-in git/pip/python: it returns while training goes on
    home = tmp_path / "home"
    (home / "normvit_jax").mkdir(parents=True)
    # STUB_FAIL: abc123 is no branch of origin (git rev-parse fails), so it is checked out as is
    worker = {**env, "HOME": str(home), "STUB_RC_python": "42", "STUB_FAIL": "refs/remotes/"}
    t0 = time.time()
    w = subprocess.run(["bash", "-c", remote], cwd=home, env=worker, capture_output=True, text=True,
                       timeout=60)
    assert w.returncode == 0 and "started on" in w.stdout, w.stderr
    rc_file = home / "normvit_run.log.rc"
    while not rc_file.exists() and time.time() - t0 < 30:
        time.sleep(0.1)
    assert rc_file.read_text().strip() == "42"  # the exit code is kept for the user
    python = [c for c in seen() if c[0] == "python"]
    assert python == [["python", "main.py", f"--config={CONFIG}", "--workdir=gs://bucket/run",
                       "--config.data.data_dir=gs://bucket/tfds"]]
    assert ["git", "checkout", "-q", "abc123"] in seen()



def test_tpu_script_dry_run_without_tpu_and_zone_prints_placeholders(stubs):
    """The header's `--dry-run CONFIG WORKDIR` example sets neither TPU nor ZONE: it exited 1
    ('TPU: set TPU to the TPU VM name') while the script's other errors exit 2. A dry run prints
    <TPU>/<ZONE> in their place; a real run without them stops with exit 2 and one line."""
    env, seen = stubs
    env = {k: v for k, v in env.items() if k not in ("TPU", "ZONE")}
    env.update(REPO="https://example.org/n.git", REF="abc123")
    dry = script("tpu_pod.sh", "--dry-run", CONFIG, "gs://bucket/run", env=env)
    assert dry.returncode == 0 and seen() == [], dry.stderr
    assert dry.stdout.startswith("gcloud compute tpus tpu-vm ssh \\<TPU\\> --zone \\<ZONE\\> "), dry.stdout
    for missing in ("TPU", "ZONE"):
        r = script("tpu_pod.sh", CONFIG, "gs://bucket/run",
                   env={**env, "TPU": "my-v4-32", "ZONE": "us-central2-b", missing: ""})
        assert r.returncode == 2 and seen() == [], r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith(f"error: set {missing} "), r.stderr


def test_tpu_script_runs_a_branch_at_its_newest_pushed_commit(stubs, tmp_path):
    """REF=main on a worker that cloned before the last push (the re-run after a preemption,
    with a fix pushed since): `git checkout main` switched to the clone's own stale branch and
    trained the old code. Real git here, stand-in pip and python."""
    env, seen = stubs
    (tmp_path / "bin" / "git").unlink()
    git = lambda *a, cwd: subprocess.run(  # noqa: E731
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=cwd, check=True,
        capture_output=True, text=True).stdout.strip()
    origin, home = tmp_path / "origin", tmp_path / "home"
    origin.mkdir()
    home.mkdir()
    git("init", "-q", "-b", "main", cwd=origin)
    (origin / "v").write_text("1")
    git("add", "v", cwd=origin)
    git("commit", "-q", "-m", "one", cwd=origin)
    git("clone", "-q", str(origin), "normvit_jax", cwd=home)  # the worker's earlier start
    (origin / "v").write_text("2")
    git("commit", "-q", "-am", "two: the fix", cwd=origin)
    env = {**env, "TPU": "t", "ZONE": "z", "REPO": str(origin), "REF": "main"}
    r = script("tpu_pod.sh", CONFIG, "gs://bucket/run", env=env)
    assert r.returncode == 0, r.stderr
    (gcloud,) = seen()
    w = subprocess.run(["bash", "-c", gcloud[10]], cwd=home, capture_output=True, text=True,
                       env={**env, "HOME": str(home)}, timeout=60)
    assert w.returncode == 0, w.stderr
    assert (git("rev-parse", "HEAD", cwd=home / "normvit_jax")
            == git("rev-parse", "HEAD", cwd=origin))
    assert (home / "normvit_jax" / "v").read_text() == "2"


def test_tpu_script_workdir_with_a_space(stubs, tmp_path):
    """The default log is named after the workdir; a space in it split the worker's unquoted
    `> $HOME/normvit_my run.log` (bash: the log went to 'normvit_my', the exit code to no .rc
    file)."""
    env, seen = stubs
    env = {**env, "TPU": "t", "ZONE": "z", "REPO": "https://example.org/n.git", "REF": "abc123"}
    r = script("tpu_pod.sh", CONFIG, "gs://bucket/my run", "--config.data.train_split=train[:90%]",
               env=env)
    assert r.returncode == 0, r.stderr
    assert """--command 'tail -f "$HOME/normvit_my run.log"'""" in r.stdout
    (gcloud,) = seen()
    home = tmp_path / "home"
    (home / "normvit_jax").mkdir(parents=True)
    t0 = time.time()
    w = subprocess.run(["bash", "-c", gcloud[10]], cwd=home, capture_output=True, text=True,
                       env={**env, "HOME": str(home), "STUB_RC_python": "42"}, timeout=60)
    assert w.returncode == 0 and f"log {home}/normvit_my run.log" in w.stdout, w.stderr
    rc_file = home / "normvit_my run.log.rc"
    while not rc_file.exists() and time.time() - t0 < 30:
        time.sleep(0.1)
    assert rc_file.read_text().strip() == "42"
    assert (home / "normvit_my run.log").exists() and not (home / "normvit_my").exists()
    assert [c for c in seen() if c[0] == "python"] == [
        ["python", "main.py", f"--config={CONFIG}", "--workdir=gs://bucket/my run",
         "--config.data.train_split=train[:90%]"]]

def test_sweep_continues_after_a_failure_and_writes_the_report(stubs):
    env, seen = stubs
    env = {**env, "PYTHON": "python"}  # the stand-in
    dry = script("sweep.sh", "--dry-run", "ln", "bn", "--", "--config.total_steps=5", env=env)
    assert dry.returncode == 0 and seen() == []
    assert dry.stdout.splitlines() == [
        "python main.py --config=configs/vit_ln.py:demo --workdir=runs/demo_ln --config.total_steps=5 ",
        "python main.py --config=configs/vit_bn.py:demo --workdir=runs/demo_bn --config.total_steps=5 ",
        "python -m normvit_jax.analysis.report runs/demo_ln runs/demo_bn --out=report/demo "]
    r = script("sweep.sh", "ln", "bn", "dtn", env={**env, "STUB_FAIL": "vit_bn.py"})
    assert r.returncode == 1
    assert "bn (exit 3)" in r.stderr
    assert [c[2] for c in seen()[:3]] == ["--config=configs/vit_ln.py:demo",
                                          "--config=configs/vit_bn.py:demo",
                                          "--config=configs/vit_dtn.py:demo"]
    assert seen()[3] == ["python", "-m", "normvit_jax.analysis.report", "runs/demo_ln",
                         "runs/demo_dtn", "--out=report/demo"]
    bad = script("sweep.sh", "--hlep", env=env)
    assert bad.returncode == 2 and seen()[4:] == []
    # no METHOD: every method config, LayerNorm first (it said "all twelve" and ran twelve of
    # seventeen: DyT, Derf, RepBN, the progressive and the dynamic feature norms were left out)
    every = script("sweep.sh", "--dry-run", env=env).stdout.splitlines()
    names = sorted(f[len("vit_"):-len(".py")] for f in os.listdir(os.path.join(REPO_ROOT, "configs"))
                   if f.startswith("vit_") and f.endswith(".py"))
    assert [line.split("--workdir=runs/demo_")[1].split()[0] for line in every[:-1]] == \
        ["ln"] + [n for n in names if n != "ln"]
    assert every[-1].startswith("python -m normvit_jax.analysis.report runs/demo_ln runs/demo_bn ")


FAKE_PROCESS = r"""#!/usr/bin/env bash
# Stand-in for `python main.py ...` under launch/local.sh: records its JAX_* environment and
# arguments, then acts as $FAKE_<JAX_PROCESS_ID> says: 'exit N', 'wait' (until SIGTERM: a line,
# exit 42; SIGINT ignored, as a script's background jobs start) or 'stubborn' (SIGTERM ignored too).
printf '%s\0' "$JAX_COORDINATOR_ADDRESS" "$JAX_NUM_PROCESSES" "$JAX_PROCESS_ID" \
  "${JAX_PLATFORMS:-}" "${XLA_FLAGS:-}" "${CUDA_VISIBLE_DEVICES:-}" "$@" > "$STUB_CALLS/p$JAX_PROCESS_ID"
what_var="FAKE_$JAX_PROCESS_ID"
case "${!what_var}" in
  exit*) exit "${!what_var#exit }" ;;
  wait) trap 'kill $!; echo "checkpointed on SIGTERM"; exit 42' TERM; sleep 30 & wait ;;
  stubborn) trap '' TERM; exec sleep 30 ;;
esac
"""


@pytest.fixture
def fake_python(tmp_path):
    calls = tmp_path / "calls"
    calls.mkdir()
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PROCESS)
    fake.chmod(0o755)
    # the scripts' own XLA_FLAGS, as where the environment sets none (tests/conftest.py sets some)
    env = {**environ_without_xla_flags(), "PYTHON": str(fake), "STUB_CALLS": str(calls)}

    def seen(i: int) -> list[str]:
        return (calls / f"p{i}").read_bytes().decode().split("\0")[:-1]

    return env, seen


def test_local_script_dry_run(fake_python):
    env, seen = fake_python
    r = script("local.sh", "--dry-run", "--processes=3", "--gpus-per-process=2", "--port=1234",
               CONFIG, "/my runs/ln", "--config.batch_size=256", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and lines[3].startswith("# then: wait for all")
    fake = env["PYTHON"]
    for i, line in enumerate(lines[:3]):
        assert line == (f"env JAX_COORDINATOR_ADDRESS=127.0.0.1:1234 JAX_NUM_PROCESSES=3 "
                        f"JAX_PROCESS_ID={i} CUDA_VISIBLE_DEVICES={2 * i}\\,{2 * i + 1} {fake} "
                        r"main.py --config=configs/vit_ln.py:s16\,cifar100 --workdir=/my\ runs/ln "
                        "--config.batch_size=256 &")
    cpu = script("local.sh", "--dry-run", "--cpu-devices=2", "--log-dir=/tmp/l", CONFIG, "wd",
                 env=env).stdout.splitlines()
    assert "JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 " in cpu[1]
    assert cpu[1].endswith("> /tmp/l/process_1.log 2>&1 &") and "JAX_PROCESS_ID=1" in cpu[1]
    for bad in (["--processes=two"], ["--cpu-devices=2", "--gpus-per-process=1"], ["--nope"], []):
        r = script("local.sh", *bad, *(["a", "b"] if bad else []), env=env)
        assert r.returncode == 2 and "error:" in r.stderr, bad


def test_local_script_sigkills_the_rest_after_a_failure(fake_python, tmp_path):
    """Process 1 fails; process 0 would wait forever (as in a collective with a dead peer): it is
    SIGKILLed after the grace and the script exits with process 1's code."""
    env, seen = fake_python
    t0 = time.time()
    r = script("local.sh", "--processes=2", "--cpu-devices=2", "--port=1234", "--grace=1",
               f"--log-dir={tmp_path}/logs", CONFIG, "wd", "--config.total_steps=3",
               env={**env, "FAKE_0": "wait", "FAKE_1": "exit 3"})
    assert r.returncode == 3, r.stderr
    assert time.time() - t0 < 20
    assert "process 1 exited with 3" in r.stderr and "SIGKILL" in r.stderr
    assert "process 0 exited with 137" in r.stderr
    for i in range(2):
        assert seen(i) == ["127.0.0.1:1234", "2", str(i), "cpu",
                           "--xla_force_host_platform_device_count=2", "", "main.py",
                           f"--config={CONFIG}", "--workdir=wd", "--config.total_steps=3"]
    ok = script("local.sh", "--port=1234", CONFIG, "wd", env={**env, "FAKE_0": "exit 0",
                                                               "FAKE_1": "exit 0"})
    assert ok.returncode == 0 and ok.stderr.count("exited with 0") == 2, ok.stderr


def test_local_script_forwards_sigterm(fake_python):
    """SIGTERM to the script reaches every process (as a scheduler's preemption notice would);
    they exit 42 and so does the script."""
    env, seen = fake_python
    p = subprocess.Popen(["bash", os.path.join(REPO_ROOT, "launch", "local.sh"), "--port=1234",
                          CONFIG, "wd"], cwd=REPO_ROOT, env={**env, "FAKE_0": "wait", "FAKE_1": "wait"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not all(os.path.exists(os.path.join(env["STUB_CALLS"], f"p{i}")) for i in range(2)):
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.2)  # the fake's trap is set right after it records its call
    p.send_signal(15)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 42, err
    assert err.count("exited with 42") == 2 and "SIGKILL" not in err


def test_local_script_sigkills_several_after_a_failure(fake_python, tmp_path):
    """Several processes SIGKILLed together after the grace: bash drops a job killed by a signal
    from its table once it has printed 'Killed', and `wait -n` failed with 'no such job' at once,
    over and over (the script never ended, flooding its stderr; with 4 killed, every time here)."""
    env, _ = fake_python
    err_file = tmp_path / "local.err"
    with open(err_file, "w") as err:
        p = subprocess.Popen(
            ["bash", os.path.join(REPO_ROOT, "launch", "local.sh"), "--processes=5", "--port=1234",
             "--grace=1", CONFIG, "wd"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err,
            env={**env, **{f"FAKE_{i}": "stubborn" for i in range(4)}, "FAKE_4": "exit 3"},
            start_new_session=True)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    with open(err_file) as f:
        text = f.read(20000)
    assert p.returncode == 3, text
    assert "no such job" not in text
    assert all(f"process {i} exited with 137" in text for i in range(4)), text


def _start_local(env, fake):
    """local.sh in its own session (as at a terminal: Ctrl-C signals the whole process group),
    once both fake processes have started."""
    # SIGINT at its default, as a terminal's shell starts a command: a suite run as a background
    # job (`pytest ... &`) passes SIGINT ignored to its children, and bash cannot trap a signal
    # ignored on entry (local.sh never heard the Ctrl-C). Reset in a Python that execs bash (same
    # pid), not in a preexec_fn: no Python runs in a forked child of this multithreaded process.
    reset = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execvp('bash', ['bash', *sys.argv[1:]])")
    p = subprocess.Popen([sys.executable, "-c", reset, os.path.join(REPO_ROOT, "launch", "local.sh"),
                          "--port=1234", CONFIG, "wd"], cwd=REPO_ROOT,
                         env={**env, "FAKE_0": fake, "FAKE_1": fake},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.time() + 30
    while not all(os.path.exists(os.path.join(env["STUB_CALLS"], f"p{i}")) for i in range(2)):
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.3)  # the fake's trap is set right after it records its call
    return p


def _finish(p, timeout=15):
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"local.sh still running {timeout} s after Ctrl-C:\n{err}")


def test_local_script_ctrl_c_stops_every_process_with_a_checkpoint(fake_python):
    """Ctrl-C at a terminal (SIGINT to local.sh's process group) became SIGINT to processes that
    ignore it (started in the background by a script; with several processes main.py installs no
    handler of its own), so nothing stopped, and the [p<i>] prefixing sed died: the run went on
    with its output lost. Now every process gets SIGTERM (checkpoint, exit 42) and its lines
    still come through."""
    env, _ = fake_python
    p = _start_local(env, "wait")
    os.killpg(p.pid, signal.SIGINT)
    out, err = _finish(p)
    assert p.returncode == 42, err
    assert err.count("exited with 42") == 2 and "SIGKILL" not in err
    assert "[p0] checkpointed on SIGTERM" in out and "[p1] checkpointed on SIGTERM" in out


def test_local_script_second_ctrl_c_kills(fake_python):
    """A second Ctrl-C does not wait for the step and the checkpoint (as main.py alone)."""
    env, _ = fake_python
    p = _start_local(env, "stubborn")
    os.killpg(p.pid, signal.SIGINT)
    time.sleep(1)
    assert p.poll() is None  # SIGTERM ignored: still running
    os.killpg(p.pid, signal.SIGINT)
    _, err = _finish(p)
    assert p.returncode == 137 and "Ctrl-C again: SIGKILL" in err, err
