"""The ``python -m`` tools parse their flags with argparse through normvit_jax.tool_flags.Parser:
--help of every tool lists its flags and exits 0; values, booleans, choices, required flags,
positionals behave as documented; a bad flag is one line on stderr and exit 2; tools sharing flag
names parse independently in one process. The docs: every flag of main.py and of each
``python -m normvit_jax`` tool is in its doc section, with the default a ``[--flag=V]`` there
shows; every flag of a command in README.md or docs/*.md exists in the module it runs."""
from __future__ import annotations

import ast
import glob
import importlib
import os
import re
import subprocess
import sys

import pytest

from normvit_jax import tool_flags
from tests.conftest import REPO_ROOT

# module -> flags its --help must list
TOOLS = {
    "benchmarks.demo_table": ["--only", "--dry-run", "--readme", "--root"],
    "benchmarks.gpu_table": ["--out", "--models", "--dry-run", "--tiny", "--no_torch", "--quick",
                             "--budget_s", "--variants", "--profile", "--compile_cache"],
    "benchmarks.compile_time": ["--model", "--depths", "--remat", "--xla_preset", "--json"],
    "benchmarks.inference": ["--norm", "--dtype", "--fold", "--json"],
    "benchmarks.input_pipeline": ["--datasets", "--batches", "--skip_run"],
    "benchmarks.matmul": ["--model", "--repeats", "--no_torch"],
    "benchmarks.memory": ["--models", "--memory_gb", "--verify"],
    "benchmarks.norm_ablation": ["--root", "--seeds", "--summary_only", "--out", "--config_args"],
    "benchmarks.profile": ["--norm", "--top", "--part", "--dtype", "--trace_dir"],
    "benchmarks.train_step": ["--model", "--norm", "--batch", "--peak_tflops", "--scan",
                              "--one_process", "--ln_variants", "--time_budget_s"],
    "benchmarks.vs_torch": ["--gelu", "--torch_threads", "--time_budget_s"],
    "normvit_jax.analysis.attention": ["--workdir", "--heads", "--blocks", "--step"],
    "normvit_jax.analysis.report": ["workdirs", "--out", "--no_attention", "--tags", "--reference",
                                    "--target"],
    "normvit_jax.reparam": ["--workdir", "--batch", "--reps", "--out"],
}


@pytest.mark.parametrize("module", sorted(TOOLS))
def test_help_of_every_tool_lists_its_flags(module, capsys):
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {module} ")
    for flag in TOOLS[module]:
        assert f"  {flag}" in out, (flag, out)


def test_help_through_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "benchmarks.matmul", "--help"], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage: python -m benchmarks.matmul" in r.stdout and "--no_torch" in r.stdout


@pytest.mark.parametrize("command", [["main.py"], ["-m", "normvit_jax.export"]])
@pytest.mark.parametrize("flag", ["--help", "-h", "--helpfull"])
def test_help_of_the_absl_commands_exits_0(command, flag):
    """main.py and export parse with absl, which exited 1 after --help (a bug, by docs/faults.md)
    and refused -h as an unknown flag 'h' (exit 2); tool_flags.absl_help serves both."""
    r = subprocess.run([sys.executable, *command, flag], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr[-2000:]
    assert "  --workdir:" in r.stdout, r.stdout[-2000:]
    assert ("Try --helpfull" in r.stdout) == (flag != "--helpfull")  # the pointer to all flags


def _parser(default_batch: int = 128) -> tool_flags.Parser:
    p = tool_flags.Parser("python -m tool", "A tool.")
    p.add_argument("--model", default="Ti/4", help="preset")
    p.add_argument("--batch", type=int, default=default_batch)
    p.add_argument("--peak", type=float, default=None)
    p.add_argument("--impl", default=None, choices=["xla", "cudnn"])
    p.add_argument("--scan", action="store_true")
    p.add_argument("--workdir", required=True)
    return p


def test_values_booleans_enums_and_both_spellings():
    args = _parser().parse_args(["--workdir", "w", "--batch=4", "--peak", "1.5", "--impl=xla",
                                 "--scan"])
    assert vars(args) == {"model": "Ti/4", "batch": 4, "peak": 1.5, "impl": "xla", "scan": True,
                          "workdir": "w"}
    args = _parser().parse_args(["--workdir=w"])
    assert (args.batch, args.peak, args.impl, args.scan) == (128, None, None, False)


@pytest.mark.parametrize("argv, message", [
    ([], "required: --workdir"),
    (["--workdir=w", "--bogus=1"], "unrecognized arguments: --bogus=1"),
    (["--workdir=w", "--impl=tpu"], "--impl: invalid choice: 'tpu'"),
    (["--workdir=w", "--batch=four"], "--batch: invalid int value: 'four'"),
    (["--workdir=w", "stray"], "unrecognized arguments: stray"),
    (["--workdir=w", "--bat=4"], "unrecognized arguments: --bat=4"),  # no abbreviations
    (["--workdirr=w"], "unrecognized arguments: --workdirr=w (did you mean --workdir?)"),
    (["--workdir=w", "--imp", "xla"], "unrecognized arguments: --imp (did you mean --impl?)"),
    (["--workdir=w", "--xyz"], "unrecognized arguments: --xyz (--help"),  # nothing alike
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m tool: error: ") and message in err, err


def test_positional_list():
    p = tool_flags.Parser("python -m tool")
    p.add_argument("workdirs", nargs="+", help="runs")
    p.add_argument("--out", required=True)
    args = p.parse_args(["a", "--out=o", "b"])
    assert args.workdirs == ["a", "b"] and args.out == "o"
    with pytest.raises(SystemExit):
        p.parse_args(["--out=o"])


def test_parsers_with_the_same_flags_are_independent():
    a, b = _parser(1), _parser(2)
    assert a.parse_args(["--workdir=w", "--batch=7"]).batch == 7
    assert b.parse_args(["--workdir=w"]).batch == 2
    assert a.parse_args(["--workdir=w"]).batch == 1  # no value kept from the first parse


def test_a_home_path_after_equals_is_expanded_as_the_shell_expands_it_after_a_space(
        monkeypatch, tmp_path):
    """bash leaves ``--src=~/photos`` as typed; the README's commands write it that way."""
    monkeypatch.setenv("HOME", str(tmp_path))
    argv = ["prog", "--src=~/photos", "--data_dir=~", "--config.data.data_dir=~/tfds", "~/pos",
            "--name=a~b", "--tag=~nosuchuser_x/y", "--scan"]
    assert tool_flags.expand_home(argv) == [
        "prog", f"--src={tmp_path}/photos", f"--data_dir={tmp_path}",
        f"--config.data.data_dir={tmp_path}/tfds", "~/pos", "--name=a~b", "--tag=~nosuchuser_x/y",
        "--scan"]
    assert _parser().parse_args(["--workdir=~/runs/a"]).workdir == f"{tmp_path}/runs/a"
    assert _parser().parse_args(["--workdir", "runs/~a"]).workdir == "runs/~a"


def test_main_py_expands_a_home_workdir(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HOME": str(tmp_path),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    r = subprocess.run([sys.executable, "main.py", "--mode=eval", "--workdir=~/none"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"error: {tmp_path}/none holds no run to evaluate" in r.stderr, r.stderr[-2000:]


# ------------------------------------------------------------------ the flags in the docs
# Where each tool's flags are documented: (file, heading that opens the section; None: the file).
DOCUMENTED_IN = {
    "main.py": ("README.md", None),
    "normvit_jax.predict": ("docs/data.md", "## Training, evaluation and prediction"),
    "normvit_jax.data.prepare": ("docs/data.md", "## Flags"),
    "normvit_jax.reparam": ("docs/norms.md", "## Folding into the next Dense at inference"),
    "normvit_jax.recalibrate": ("docs/norms.md", "## Recalibrating running statistics"),
    "normvit_jax.export": ("docs/deploy.md", "## `python -m normvit_jax.export`"),
    "normvit_jax.serve": ("docs/deploy.md", "## `python -m normvit_jax.serve`"),
    "normvit_jax.analysis.attention": ("docs/analysis.md", "## Commands"),
    "normvit_jax.analysis.report": ("docs/analysis.md", "## Commands"),
}
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO_ROOT) for p in
                              glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))


class _Parsed(Exception):
    pass


def _flags(module: str) -> dict[str, object]:
    """``{'--flag': default}`` of a tool: its tool_flags.Parser as built by its parse/main, or the
    absl flags it defines (main.py, export)."""
    if module in ("main.py", "normvit_jax.export"):
        path = "main.py" if module == "main.py" else "normvit_jax/export.py"
        with open(os.path.join(REPO_ROOT, path)) as f:
            src = f.read()
        return {f"--{n}": ast.literal_eval(d) for n, d in
                re.findall(r'DEFINE_\w+\(\s*"(\w+)",\s*([^,]+),', src)}
    return {a.option_strings[0]: a.default for a in _parser_of(module)._actions
            if a.option_strings and a.option_strings[0] != "-h"}


def _parser_of(module: str):
    """The tool_flags.Parser a tool's parse/main builds, caught as it parses (nothing runs)."""
    mod = importlib.import_module(module)

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    parse = getattr(mod, "parse", None) or mod.main
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tool_flags.Parser, "parse_args", capture)
        with pytest.raises(_Parsed) as e:
            parse([])
    return e.value.args[0]


def _section(text: str, heading: str | None) -> str:
    if heading is None:
        return text
    start = text.index("\n" + heading) + 1
    level = heading.split(" ")[0]
    end = re.search(rf"^#{{1,{len(level)}}} ", text[start + len(heading):], re.MULTILINE)
    return text[start:start + len(heading) + end.start()] if end else text[start:]


@pytest.mark.parametrize("module", sorted(DOCUMENTED_IN))
def test_every_flag_is_in_its_doc_section_with_its_default(module):
    path, heading = DOCUMENTED_IN[module]
    with open(os.path.join(REPO_ROOT, path)) as f:
        section = _section(f.read(), heading)
    flags = _flags(module)
    assert flags, module
    missing = [f for f in flags if not re.search(rf"{re.escape(f)}(?![\w-])", section)]
    assert not missing, f"{module}: flags not in {path} {heading or ''}: {missing}"
    # ``[--flag=V]`` shows the default (V in capitals is a placeholder: DIR, N)
    for flag, shown in re.findall(r"\[(--[\w-]+)=([^\s\]|]+)", section):
        default = flags.get(flag)
        if flag in flags and default not in (None, False, "") and not shown.isupper():
            assert shown == str(default), f"{module}: {path}: {flag}={shown}, default {default}"


BENCHMARKS = sorted(f"benchmarks.{os.path.basename(p)[:-3]}" for p in
                    glob.glob(os.path.join(REPO_ROOT, "benchmarks", "*.py"))
                    if "tool_flags.Parser(" in open(p).read())


@pytest.mark.parametrize("module", BENCHMARKS)
def test_every_benchmark_flag_is_in_docs_benchmarks(module):
    """The benchmarks' flags were in their --help only (demo_table --readme, vs_torch --gelu,
    ...): every flag of each ``python -m benchmarks.<name>`` is named in docs/benchmarks.md."""
    with open(os.path.join(REPO_ROOT, "docs", "benchmarks.md")) as f:
        text = f.read()
    flags = _flags(module)
    assert flags, module
    missing = [f for f in flags if not re.search(rf"{re.escape(f)}(?![\w-])", text)]
    assert not missing, f"{module}: flags not in docs/benchmarks.md: {missing}"


def _doc_commands(text: str):
    """(line, command) of every ``python main.py`` / ``python -m ...`` in inline code and in code
    blocks (continued by a trailing backslash or an indented ``[`` / ``--`` line)."""
    lines, inline, fence = text.split("\n"), [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        code = fence or line.startswith("    ")
        inline.append("" if code else line)
        if code and "python" in line:
            cmd, j = line, i + 1
            while j < len(lines) and (cmd.endswith("\\") or re.match(r"\s+(\[|--)", lines[j])):
                cmd, j = cmd.rstrip("\\") + " " + lines[j], j + 1
            yield i + 1, cmd
    prose = "\n".join(inline)
    for m in re.finditer(r"`([^`]+)`", prose):
        if "python" in m.group(1):
            yield prose[:m.start()].count("\n") + 1, m.group(1)


def test_every_flag_a_doc_command_passes_exists():
    """What README.md and docs/*.md tell users to type: the module exists and takes each flag."""
    known: dict[str, dict] = {}
    bad = []
    for path in DOCS:
        with open(os.path.join(REPO_ROOT, path)) as f:
            text = f.read()
        for line, cmd in _doc_commands(text):
            cmd = re.sub(r"'[^']*'|\"[^\"]*\"", "''", cmd)  # values such as --variants='a=--x'
            for m in re.finditer(r"python (?:-m ((?:normvit_jax|benchmarks)\.[\w.]+)|(main\.py))",
                                 cmd):
                module = m.group(1) or "main.py"
                rest = re.split(r"python |[;|&#]", cmd[m.end():])[0]
                if module not in known:
                    try:
                        known[module] = _flags(module)
                    except (ImportError, AttributeError) as e:
                        bad.append(f"{path}:{line}: {module}: {e}")
                        continue
                for flag in re.findall(r"(?<![\w.=-])(--[\w-]+)(?![\w.])", rest):
                    if flag not in known[module] and flag != "--help":
                        bad.append(f"{path}:{line}: {module} has no {flag}")
    assert len(known) >= 10, sorted(known)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("flag", ["--batch=0", "--batch=-2", "--reps=0"])
def test_reparam_counts_below_1_are_one_line_exit_2(flag, capsys):
    """--batch=0 was a JAX traceback, --reps=0 'min() arg is an empty sequence' after the work."""
    from normvit_jax import reparam
    with pytest.raises(SystemExit) as e:
        reparam.main(["--workdir=w", flag])
    name, value = flag[2:].split("=")
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"python -m normvit_jax.reparam: error: argument --{name}: {value} is not accepted; "
        "accepted: an integer >= 1 (--help lists the flags)\n")


@pytest.mark.parametrize("flag, message", [
    ("--format=tflite", "flag --format=tflite: value should be one of <npz|onnx|savedmodel|stablehlo>"),
    ("--step=abc", "flag --step=abc: invalid literal for int()"),
    ("--bogus=1", "Unknown command line flag 'bogus'"),
])
def test_export_refuses_a_bad_flag_in_one_line_exit_2(flag, message, tmp_path):
    """export parses with absl (main.py shares its flags), whose own error is 'FATAL Flags parsing
    error' and exit 1; the command answers as every tool: one line, exit 2, nothing written."""
    r = subprocess.run([sys.executable, "-m", "normvit_jax.export", f"--workdir={tmp_path}/w",
                        f"--out={tmp_path}/m.onnx", flag], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    lines = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("python -m normvit_jax.export: error: ") and message in lines[0]
    assert "Traceback" not in r.stderr and os.listdir(tmp_path) == []


def _argparse_tools() -> list[str]:
    """Every ``python -m`` tool that parses with tool_flags.Parser: the package's and each
    benchmark with a ``main``."""
    out = ["normvit_jax.predict", "normvit_jax.data.prepare", "normvit_jax.reparam",
           "normvit_jax.recalibrate", "normvit_jax.serve", "normvit_jax.analysis.attention",
           "normvit_jax.analysis.report"]
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "benchmarks", "*.py"))):
        with open(path) as f:
            if re.search(r"^def main\(", f.read(), re.MULTILINE):
                out.append("benchmarks." + os.path.basename(path)[:-3])
    return out


@pytest.mark.parametrize("module", _argparse_tools())
def test_every_flag_of_every_tool_has_a_description(module):
    """--help of the benchmarks listed 88 flags as a bare name and default (`--image_size
    IMAGE_SIZE`, `--xla_preset {tuned,default}`, `--json JSON`): what each does was only in the
    source."""
    actions = [a for a in _parser_of(module)._actions if a.dest != "help"]
    assert actions, module
    assert [a.option_strings or a.dest for a in actions if not (a.help or "").strip()] == []


def _sizes_of(module: str) -> list[str]:
    with open(os.path.join(REPO_ROOT, *module.split(".")) + ".py") as f:
        src = f.read()
    return [f for f in ("--image_size", "--depth", "--num_classes", "--batch_per_device")
            if f'"{f}"' in src]


@pytest.mark.parametrize("module, flag", [(m, f) for m in _argparse_tools() if m.startswith(
    "benchmarks.") for f in _sizes_of(m)])
def test_a_benchmark_size_below_1_is_one_line_exit_2(module, flag, capsys):
    """--image_size=-3 was a JAX traceback (exit 1) after the imports, --depth=0 'model.depth is
    not set' (0 read as unset)."""
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as e:
        (getattr(mod, "parse", None) or mod.main)([f"{flag}=0"])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(
        f": error: argument {flag}: 0 is not accepted; accepted: an integer >= 1 "
        "(--help lists the flags)\n")


@pytest.mark.parametrize("module", ["normvit_jax.analysis.attention",
                                    "normvit_jax.analysis.report", "normvit_jax.recalibrate"])
def test_an_empty_out_is_refused_before_the_work(module, tmp_path, monkeypatch, capsys):
    """--out=$UNSET: analysis.attention wrote its 11 PNG and CSV files into the current folder,
    analysis.report ended in a FileNotFoundError traceback (exit 1)."""
    monkeypatch.chdir(tmp_path)
    argv = (["workdir_a"] if module.endswith("report") else ["--workdir=w"]) + ["--out="]
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 2 and "--out is empty (an unset shell variable?); pass the path of a " \
        "folder" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, message", [
    (["--out={d}/y.onnx"], "--out={d}/y.onnx ends in .onnx but --format is npz (the default): "
                           "add --format=onnx"),
    (["--out={d}/y.npz", "--format=onnx"], "--out={d}/y.npz ends in .npz but --format is onnx: "
                                           "use --format=npz, or an --out ending in .onnx"),
    (["--out={d}/y.onnx", "--format=savedmodel"], "--out={d}/y.onnx ends in .onnx but --format "
     "is savedmodel: use --format=onnx, or a folder name without .onnx"),
])
def test_export_refuses_an_out_whose_suffix_names_another_format(argv, message, tmp_path):
    """--out=y.onnx without --format wrote an npz (a zip) named y.onnx, exit 0; serving it then
    failed with 'y.onnx.json not found'. Refused before the run is read: one line, exit 2."""
    from normvit_jax import export
    r = subprocess.run([sys.executable, "-m", "normvit_jax.export", f"--workdir={tmp_path}/w"]
                       + [a.format(d=tmp_path) for a in argv], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == \
        "python -m normvit_jax.export: error: " + message.format(d=tmp_path)
    assert os.listdir(tmp_path) == []
    for out, fmt in (("m.npz", "npz"), ("m", "npz"), ("m.onnx", "onnx"), ("sm", "savedmodel"),
                     ("m.stablehlo", "stablehlo"), ("m.bin", "onnx")):
        export.check_out_suffix(out, fmt)  # a format's own suffix, or none it names: accepted


def test_export_help_describes_out_per_format():
    """--out was 'Output .npz path' though it is the path of every format."""
    from absl import flags
    from normvit_jax import export
    export.define_flags()
    text = flags.FLAGS["out"].help
    for words in ("npz: a .npz file", "onnx: a .onnx file", "stablehlo: a .stablehlo file",
                  "savedmodel: a folder"):
        assert words in text, text
