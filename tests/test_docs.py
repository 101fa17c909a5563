"""The docs against the tree: every relative link and anchor of README.md and docs/*.md resolves,
every key of configs/default.py has its comment (the README says so), every .py file that
docs/design.md names exists, every ``module.name`` the docs name exists (and a call shown with
its arguments binds), and every config a doc shows loads with the keys it overrides.
Flags: tests/test_tool_flags.py; demo numbers: test_demo_numbers.py."""
from __future__ import annotations

import glob
import os
import re

import ml_collections

from configs import default
from tests.conftest import REPO_ROOT

DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO_ROOT) for p in
                              glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))


def _read(path: str) -> str:
    with open(os.path.join(REPO_ROOT, path)) as f:
        return f.read()


def _anchors(path: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but '-' and '_' dropped, spaces as '-',
    a repeated id suffixed -1, -2, ..."""
    out, fence = set(), False
    for line in _read(path).split("\n"):
        fence ^= line.startswith("```")
        m = None if fence else re.match(r"#{1,6} (.+?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = 0
            while (slug if n == 0 else f"{slug}-{n}") in out:
                n += 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_and_anchor_resolves():
    bad, checked = [], 0
    for path in DOCS:
        for m in re.finditer(r"\]\(([^)\s]+)\)", _read(path)):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            checked += 1
            file, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(os.path.join(REPO_ROOT, resolved)):
                bad.append(f"{path}: {target}: no file {resolved}")
            elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
                bad.append(f"{path}: {target}: no heading #{anchor} in {resolved}")
    assert checked > 20
    assert not bad, "\n".join(bad)


def _keys(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    out = []
    for k in c:
        key = f"{prefix}{k}"
        out.append(key)
        if isinstance(c[k], ml_collections.ConfigDict) and key not in ("model.norm",
                                                                        "model.norm_overrides"):
            out += _keys(c[k], key + ".")
    return out


def test_every_default_config_key_has_a_comment():
    src = _read("configs/default.py")
    body = src[src.index("def get_config"):src.index("\ndef ", src.index("def get_config") + 1)]
    lines = {m.group(1): m.group(2)
             for m in re.finditer(r"^ +c\.([\w.]+) = (.*)$", body, re.MULTILINE)}
    keys = _keys(default.get_config())
    assert len(keys) > 100 and set(keys) <= set(lines), sorted(set(keys) - set(lines))
    sections = {k for k, v in lines.items() if v == "ml_collections.ConfigDict()"
                and k not in ("model.norm_overrides",)}  # under a '# ---- ... ----' header
    bare = [k for k in keys if k not in sections and "#" not in lines[k]]
    assert not bare, f"configs/default.py keys without a comment: {bare}"


def test_every_file_design_md_names_exists():
    text = _read("docs/design.md")
    tree = {os.path.relpath(p, REPO_ROOT) for p in glob.glob(os.path.join(REPO_ROOT, "**", "*.py"),
                                                             recursive=True)}
    names = set(re.findall(r"(?<![\w/.])([\w/]+\.py)\b", text))
    assert len(names) > 60
    missing = [n for n in sorted(names) if not any(p == n or p.endswith("/" + n) for p in tree)]
    assert not missing, f"docs/design.md names files that do not exist: {missing}"


def test_readme_names_every_method_config_and_default_variant():
    """README names every configs/vit_<method>.py and every variant of configs/default.py."""
    readme = _read("README.md")
    configs = [os.path.basename(p)
               for p in glob.glob(os.path.join(REPO_ROOT, "configs", "vit_*.py"))]
    assert len(configs) > 15
    assert [c for c in sorted(configs) if f"`{c}`" not in readme] == []
    assert [v for v in default.VARIANTS if f"`{v}`" not in readme] == []


def test_every_config_a_doc_shows_loads_and_has_the_keys_it_overrides():
    """Every ``--config=configs/FILE.py[:variants]`` in README.md and docs/*.md (commands, tables,
    prose) loads, and every ``--config.KEY=`` on a ``python main.py`` command with such a config
    is a key of it (a misspelt or removed key or variant in a doc stops the user's first run;
    model.norm.* and model.norm_overrides.* take new keys)."""
    from normvit_jax import cli
    from tests.test_tool_flags import _doc_commands
    loaded: dict[str, object] = {}
    bad = []

    def load(spec: str):
        if spec not in loaded:
            try:
                loaded[spec] = cli.load_config_file(os.path.join(REPO_ROOT, spec))
            except Exception as e:  # noqa: BLE001  (reported below with the doc line)
                loaded[spec] = e
        return loaded[spec]

    spec_re = r"--config=(configs/\w+\.py(?::[\w,]+)?)(?=[\s`'|)]|$)"
    for path in DOCS:
        text = _read(path)
        for m in re.finditer(spec_re, text):
            c = load(m.group(1))
            if isinstance(c, Exception):
                line = text[:m.start()].count("\n") + 1
                bad.append(f"{path}:{line}: --config={m.group(1)}: {type(c).__name__}: {c}")
        for line, cmd in _doc_commands(text):
            for run in re.finditer(r"python main\.py([^;|&#]*)", cmd):
                spec = re.search(spec_re, run.group(1))
                c = load(spec.group(1)) if spec else None
                if c is None or isinstance(c, Exception):
                    continue
                for key in re.findall(r"--config\.([\w.]+)=", run.group(1)):
                    if key.startswith(("model.norm.", "model.norm_overrides.")):
                        continue
                    node = c
                    for k in key.split("."):
                        node = node[k] if hasattr(node, "keys") and k in node.keys() else None
                        if node is None:
                            break
                    if node is None and not _leaf_is_none(c, key):
                        bad.append(f"{path}:{line}: --config={spec.group(1)} has no key {key}")
    assert len(loaded) >= 20, sorted(loaded)
    assert not bad, "\n".join(bad)


def _leaf_is_none(c: ml_collections.ConfigDict, key: str) -> bool:
    """A key that exists with the value None (init_from, data.data_dir, ...)."""
    *path, leaf = key.split(".")
    for k in path:
        if not (hasattr(c, "keys") and k in c.keys()):
            return False
        c = c[k]
    return hasattr(c, "keys") and leaf in c.keys()


def test_the_adding_a_norm_example_of_norms_md_trains_evaluates_and_folds(monkeypatch, tmp_path):
    """docs/norms.md "Adding a norm": its three blocks, as written (the file, the registry line,
    the config), register a norm that the unchanged loop trains and evaluates, with running
    statistics that move, and that reparam folds with the same logits."""
    import sys
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    from normvit_jax import models, reparam
    from normvit_jax.norms import registry
    from normvit_jax.train import loop
    text = _read("docs/norms.md").split("## Adding a norm\n")[1].split("\n## ")[0]
    norm_src, entry_src, config_src = re.findall(r"```python\n(.*?)```", text, re.DOTALL)[:3]
    module = types.ModuleType("docs_example_norm")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # before: dataclasses look it up
    exec(compile(norm_src, "docs/norms.md", "exec"), module.__dict__)  # noqa: S102
    name, target = re.search(r'"(\w+)": "([\w.]+:\w+)"', entry_src).groups()
    cls_name = target.split(":")[1]
    monkeypatch.setitem(registry._ENTRIES, name, f"{module.__name__}:{cls_name}")
    config_mod = types.ModuleType("docs_example_config")
    exec(compile(config_src, "docs/norms.md", "exec"), config_mod.__dict__)  # noqa: S102

    c = config_mod.get_config("demo")
    assert c.model.norm.name == name
    for k, v in dict(hidden_size=32, depth=2, num_heads=2, mlp_dim=64).items():
        c.model[k] = v
    c.batch_size, c.eval_batch_size, c.total_steps = 32, 64, 2
    c.log_every = c.eval_every = c.checkpoint_every = 2
    c.eval_analysis_images = 0
    out = loop.train_and_evaluate(c, str(tmp_path / "run"))
    assert out["step"] == 2 and np.isfinite(float(out["eval"]["loss"]))
    assert jax.tree.leaves(out["state"].batch_stats)  # the running statistic is in the state

    model_cfg = c.model.to_dict()
    model = models.create(model_cfg, 10)
    images = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    variables = model.init(jax.random.key(1), images, train=False)
    _, mutated = model.apply(variables, images, train=True, mutable=["batch_stats"],
                             rngs={"dropout": jax.random.key(2)})
    assert not all(bool(jnp.all(a == b)) for a, b in
                   zip(jax.tree.leaves(mutated), jax.tree.leaves(variables["batch_stats"])))
    variables = {"params": jax.tree.map(lambda p: p + 0.1 * jax.random.normal(
        jax.random.key(3), p.shape), variables["params"]), **mutated}
    want = np.asarray(model.apply(variables, images, train=False))
    spec, folded, report = reparam.fold(model_cfg, variables)
    assert len(report.folded) == 5 and not report.kept
    got = np.asarray(models.create(spec, 10).apply(folded, images, train=False))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _module_refs(text: str):
    """(line, 'mod.attr', args or None) for every ``mod.attr`` / ``mod.attr(args)`` whose ``mod`` is
    the last name of a normvit_jax module or its dotted path (``checkpoints.first_restorable``,
    ``models.layers.matmul_attention``, ``normvit_jax.summaries.read_scalars(workdir)``); args
    only for a call without nested parentheses or '...'."""
    pattern = (r"(?<![\w./\-])((?:[a-z_]\w*\.)*[a-z_]\w*)\.([A-Za-z_]\w*)\b(?![.\-/:][\w<])"
               r"(?:\(([^()]*)\))?")
    for m in re.finditer(pattern, text):
        args = m.group(3)
        yield (text[:m.start()].count("\n") + 1, m.group(1), m.group(2),
               None if args is None or "..." in args else args)


def test_every_function_the_docs_name_by_module_exists_and_takes_the_arguments_shown():
    """Every ``mod.name`` of README.md and docs/*.md whose ``mod`` is a normvit_jax module (by its
    last name: ``cli.EXIT_CODES``, ``eval_hook.fixed_images``) is an attribute or submodule of it,
    and a call shown with its arguments (``setup.resolve_config(config, num_devices)``) binds to
    its signature: a renamed function or a changed signature leaves no stale name in the docs.
    ``data.X`` / ``optimizer.X`` / ... may instead be a key of that section of configs/default.py;
    ``state.step`` is the train state's field."""
    import importlib
    import importlib.util
    import inspect
    import pkgutil

    import normvit_jax
    modules: dict[str, list[str]] = {"normvit_jax": ["normvit_jax"]}  # last name -> modules
    for info in pkgutil.walk_packages(normvit_jax.__path__, "normvit_jax."):
        modules.setdefault(info.name.rsplit(".", 1)[1], []).append(info.name)
    config = default.get_config()
    skip_suffix = ("py", "md", "json", "npz", "npy", "png", "csv", "txt", "onnx", "stablehlo", "sh")
    bad, checked, calls = [], 0, 0
    for path in DOCS:
        for line, mod, name, args in _module_refs(_read(path)):
            key = mod.rsplit(".", 1)[-1]
            if "." in mod:  # a dotted path: only normvit_jax's (not jax.export.deserialize)
                mod = mod if mod.startswith("normvit_jax.") else f"normvit_jax.{mod}"
                if mod not in modules.get(key, []):
                    continue
            if key not in modules or name in skip_suffix or key == "state":
                continue
            obj, found = None, False
            for mod_name in modules[key] if mod == key else [mod]:
                module = importlib.import_module(mod_name)
                if hasattr(module, name):
                    obj, found = getattr(module, name), True
                    break
                if hasattr(module, "__path__") and importlib.util.find_spec(f"{mod_name}.{name}"):
                    found = True  # a subpackage's module (analysis.attention)
                    break
            if not found and key in config and hasattr(config[key], "keys") and name in config[key]:
                continue  # a config key (data.image_size)
            checked += 1
            if not found:
                bad.append(f"{path}:{line}: {mod}.{name}: no such name in {modules.get(key, mod)}")
                continue
            if args is None or not callable(obj):
                continue
            parts = [a.strip() for a in args.split(",") if a.strip()]
            keywords = [a.split("=")[0].strip() for a in parts if re.match(r"\w+\s*=", a)]
            positional = len(parts) - len(keywords)
            try:
                signature = inspect.signature(obj)
            except (TypeError, ValueError):
                continue
            calls += 1
            try:
                signature.bind(*range(positional), **dict.fromkeys(keywords))
            except TypeError as e:
                bad.append(f"{path}:{line}: {mod}.{name}({args.strip()}): {e} (the code has "
                           f"{name}{signature})")
    assert checked > 50 and calls > 10, (checked, calls)
    assert not bad, "\n".join(bad)


def test_design_md_names_every_module_of_the_package():
    """docs/design.md's module map names every module of normvit_jax/ (by file name, or by name
    in a '(+ a, b)' list), so a new module is placed in it; norms/ and analysis/ are described as
    families ("one file per normalizer family") and are not listed file by file."""
    text = _read("docs/design.md")
    section = text.split("## Modules and their one purpose\n")[1].split("\n## ")[0]
    package = os.path.join(REPO_ROOT, "normvit_jax")
    unnamed = []
    for p in sorted(glob.glob(os.path.join(package, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(p, package)
        folder, stem = os.path.dirname(rel), os.path.basename(rel)[:-3]
        if folder in ("norms", "analysis") or stem == "__init__":
            continue
        if not re.search(rf"(?<!\w){re.escape(stem)}(\.py)?\b", section):
            unnamed.append(rel)
    assert not unnamed, f"docs/design.md's module map does not name: {unnamed}"


def test_imports_go_the_one_way_design_md_says():
    """docs/design.md: "Imports go one way: norms <- models <- train; data and sharding stand
    beside models (models never imports data)". Every import in norms/, models/, data/ and
    sharding.py (module level or inside a function) is checked with ast."""
    import ast
    forbidden = {"norms": ("models", "train", "data", "analysis", "sharding"),
                 "models": ("train", "data", "analysis", "sharding"),
                 "data": ("models", "train", "norms", "analysis"),
                 "sharding.py": ("models", "train", "norms", "data", "analysis")}
    bad = []
    for where, banned in forbidden.items():
        root = os.path.join(REPO_ROOT, "normvit_jax", where)
        files = [root] if where.endswith(".py") else glob.glob(os.path.join(root, "*.py"))
        for path in files:
            for node in ast.walk(ast.parse(_read(path))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "normvit_jax" and len(parts) > 1 and parts[1] in banned:
                        bad.append(f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno}: {name}")
    assert not bad, f"imports against docs/design.md's direction: {bad}"


def test_norms_md_options_are_the_norms_options_with_their_defaults():
    """In each docs/norms.md section of registered norms (``## layernorm``, ``## dtn, dtn_var``),
    every option its "Options:" list names (outside parentheses) is a dataclass field of one of
    those norms, and a default written first in its parentheses (``epsilon`` (1e-6), ``schedule``
    ('linear')) is the field's default."""
    import ast
    import dataclasses

    from normvit_jax.norms import registry
    bad, checked = [], 0
    for section in _read("docs/norms.md").split("\n## ")[1:]:
        head = section.split("\n")[0]
        names = [n for n in re.findall(r"\w+", head.split(":")[0]) if n in registry._ENTRIES]
        if not names:
            continue
        fields = {}
        for n in names:
            for f in dataclasses.fields(registry.resolve(n)):
                fields.setdefault(f.name, f)
        for m in re.finditer(r"Options?:", section):
            rest = section[m.end():]
            end = re.search(r"\.\s+[A-Z]|\n\n", rest)
            body, depth, top = rest[:end.start() if end else len(rest)], 0, []
            for i, ch in enumerate(body):  # the option names: backticks outside parentheses
                depth += (ch == "(") - (ch == ")")
                top.append(depth == 0 or ch == "(")
            for om in re.finditer(r"`(\w+)`", body):
                if not top[om.start()]:
                    continue
                option, checked = om.group(1), checked + 1
                if option not in fields:
                    bad.append(f"## {head}: `{option}` is not an option of {names}")
                    continue
                lit = re.match(r"\s*\(\s*([-+]?\d[\w.+-]*|True|False|None|'[^']*')\s*[),;:]",
                               body[om.end():])
                default = fields[option].default
                if lit and default is not dataclasses.MISSING and \
                        ast.literal_eval(lit.group(1)) != default:
                    bad.append(f"## {head}: `{option}` ({lit.group(1)}) but the code's default "
                               f"is {default!r}")
    assert checked > 50, checked
    assert not bad, "\n".join(bad)


def test_every_public_function_of_the_package_has_type_hints():
    """The project's standard (type hints on public functions), kept mechanically: every
    module-level function of normvit_jax not starting with '_' annotates its return and every
    argument but self/cls."""
    import ast
    import glob
    missing = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "normvit_jax", "**", "*.py"),
                                 recursive=True)):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                args = [a for a in node.args.args + node.args.kwonlyargs
                        if a.arg not in ("self", "cls")]
                if node.returns is None or any(a.annotation is None for a in args):
                    missing.append(f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno} {node.name}")
    assert not missing, missing


def test_benchmarks_md_lists_every_norm_the_harness_takes_in_the_layout_it_builds():
    """docs/benchmarks.md's ``--norm`` sentence names exactly ``benchmarks.common.NORMS`` (it had
    14 of 22: repbn, dyt, ... were missing, dpn was called a registry name), and its layout claim
    is bench_config's: every slot of default.py's ViT, DTN's class token from block 0, not
    vit_dtn.py's late class token (the doc said "in its method's config")."""
    from benchmarks import common
    text = _read("docs/benchmarks.md")
    sentence = text[text.index("`--norm` takes"):]
    sentence = sentence[:sentence.index("or `all`")]
    assert sorted(set(re.findall(r"`([a-z_]+)`", sentence))) == sorted(common.NORMS)
    assert int(re.search(r"it now runs (\d+)", text).group(1)) == len(common.NORMS)
    dtn = common.bench_config("Ti/4", "dtn")
    assert dtn.model.norm.name == "dtn" and dtn.model.cls_token_at_block == 0
    assert "not its\nmethod's layout" in text and "class token from block 0" in text
    rescale = common.bench_config("Ti/4", "rescale")
    assert rescale.model.final_norm is False and rescale.model.residual_scaling == "rescale"


def test_the_eval_file_name_the_readme_shows_is_the_one_written():
    """README's ``--mode=eval`` example of a sliced split names the file evaluation.result_path
    writes (a user looking for ``eval_..._train[:2%]_...json`` found nothing: the brackets, ':'
    and '%' become '-')."""
    import types

    from normvit_jax import evaluation
    name, split, step = re.search(r"`train\[:2%\]` writes `W/eval_(imagenet2012)_(\S+?)_(\d+)\.json`",
                                  _read("README.md")).groups()
    spec = types.SimpleNamespace(eval_name="imagenet2012", eval_split="train[:2%]")
    assert evaluation.result_path("W", spec, int(step)).name == f"eval_{name}_{split}_{step}.json"
