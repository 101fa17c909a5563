"""Checks that run before anything is written or JAX starts (``cli.run`` calls ``check`` first):
the config loaded, its run length and every numeric value are in range (config_ranges.py), the
model it describes can be built, the workdir path can be a directory, every gs:// path (workdir,
data_dir, init_from) has Google Cloud credentials, and ``init_from`` is a readable .npz (or a
PyTorch state dict file, with torch installed where it needs it). A failed
check changes nothing on disk, so the corrected command starts cleanly.
"""
from __future__ import annotations

import os
from typing import Any

from etils import epath

from normvit_jax import config_ranges, run_config
from normvit_jax import workdir as workdir_lib

GCE_PRODUCT_FILE = "/sys/class/dmi/id/product_name"  # 'Google Compute Engine' on Cloud VMs

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # an .npz is a zip archive (empty archive: the 2nd)
NPY_MAGIC = b"\x93NUMPY"
# what config.init_from reads: an .npz, or a PyTorch state dict (state_dict.SAFETENSORS + TORCH)
INIT_SUFFIXES = (".npz", ".safetensors", ".pth", ".pt", ".bin")
ACCEPTED = f"(accepted: {', '.join(INIT_SUFFIXES)})"
# in a folder holding weights (an HF hub folder): the file to name, preferred first
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class ConfigFileError(ValueError):
    """--config names a file that cannot be loaded (exit 2)."""


def check(config: Any, workdir: str) -> None:
    """Raises ValueError (exit 2) or workdir.WorkdirError (exit 5) naming the first problem."""
    check_loaded(config)
    check_keys(config)
    check_values(config)
    check_model(config)
    check_workdir_path(workdir)
    check_empty_paths(config)
    # init_from is read only by a run that starts at step 0: a resumed run does not need it
    resuming = not workdir_lib.is_remote(workdir) and os.path.isdir(workdir) \
        and run_config.has_checkpoint(os.path.abspath(workdir))
    init_from = None if resuming else config.init_from
    data_dir = config.data.data_dir
    for what, path in (("the workdir", workdir), ("config.data.data_dir", data_dir),
                       ("config.init_from", init_from)):
        if path and str(path).startswith("gs://"):
            check_gcs_credentials(str(path), what=what)
    from normvit_jax import state_dict  # imports jax (CheckpointError): not before it is needed
    if init_from and config.get("init_source_grid"):
        from normvit_jax.models import google_layout
        google_layout.parse_grid(config.init_source_grid, key="config.init_source_grid")
    if init_from and not workdir_lib.is_remote(init_from) and state_dict.is_state_dict_path(init_from):
        state_dict.check(init_from, key="config.init_from")  # timm / PyTorch (docs/pretrained.md)
    elif init_from and not workdir_lib.is_remote(init_from):
        check_npz(init_from, key="config.init_from", missing_hint=(
            "; download the checkpoint first, e.g. `wget https://storage.googleapis.com/"
            "vit_models/imagenet21k/ViT-B_16.npz` (public; the files and their layouts: "
            "docs/pretrained.md)"))


# Path keys whose None has a meaning an empty string must not take: ``--config.init_from=$UNSET``
# trained from scratch (an empty init_from read as "none") with exit 0.
PATH_KEYS = {"init_from": "train from scratch", "data.data_dir": "tfds's default folder"}


def check_empty_paths(config: Any) -> None:
    """Raises ValueError naming a path key set to an empty string."""
    for key, none_means in PATH_KEYS.items():
        node = config
        for part in key.split("."):
            node = node.get(part) if hasattr(node, "get") else None
        if isinstance(node, str) and not node.strip():
            raise ValueError(f"config.{key} is empty (an unset shell variable?); pass a path, or "
                             f"leave it out (None: {none_means})")


def check_loaded(config: Any) -> None:
    """config_flags defers a failed load (a missing file, an error inside it) to the first access
    of the config; this turns it into one line instead of a traceback from the training loop."""
    try:
        config.get("data")
    except Exception as e:  # noqa: BLE001  (config_flags raises IOError wrapping the cause)
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        cause = lines[-1] if lines else type(e).__name__
        raise ConfigFileError(f"cannot load the --config file: {cause}") from None


# Groups whose keys are free (a norm's options, the blocks of norm_overrides): building the model
# checks them (check_model), not this list.
FREE_GROUPS = ("model.norm", "model.norm_overrides", "model.stem_norm")


def known_keys() -> Any:
    """configs/default.py's config with the keys a config file of this project adds to it
    (T2T-ViT's model keys: configs/recipes.py t2t_vit); no JAX."""
    from configs import default, recipes  # pylint: disable=import-outside-toplevel
    return recipes.t2t_vit(default.get_config())


def unknown_keys(config: Any) -> list[str]:
    """Dotted keys of ``config`` that ``known_keys`` lacks (outside ``FREE_GROUPS``)."""
    from normvit_jax import config_paths  # pylint: disable=import-outside-toplevel
    known = set(config_paths._paths(known_keys()))  # pylint: disable=protected-access
    return [p for p in config_paths._paths(config)  # pylint: disable=protected-access
            if p not in known and not any(p.startswith(g + ".") for g in FREE_GROUPS)]


def check_keys(config: Any) -> None:
    """An unlocked config (``get_config()`` in Python, set by attribute) takes a misspelt key
    silently, and the run trains with the default: raises ValueError naming every key that
    configs/default.py (with ``known_keys``' additions) lacks and the keys it likely meant. A
    locked config (main.py's --config: ``lock_config``) is left alone: it holds its config file's
    keys, and the lock refuses a misspelt override already."""
    if getattr(config, "is_locked", True):
        return
    unknown = unknown_keys(config)
    unknown = [p for p in unknown if not any(p.startswith(u + ".") for u in unknown)]
    if not unknown:
        return
    from normvit_jax import config_paths  # pylint: disable=import-outside-toplevel
    known = known_keys()
    named = []
    for path in unknown:
        guesses = config_paths.closest(known, path)
        named.append(f"config.{path}" + (" (did you mean " + " or ".join(
            f"config.{g}" for g in guesses) + "?)" if guesses else ""))
    raise ValueError(f"unknown config key{'s' if len(named) > 1 else ''} {', '.join(named)}: "
                     "not a key of configs/default.py, so the run would ignore it; the keys and "
                     "their meaning: configs/default.py")


def check_values(config: Any) -> None:
    """The run length, then every numeric key against its range (ValueError, exit 2)."""
    check_run_length(config)
    config_ranges.check(config)
    config_ranges.check_extra_losses(config)


def check_model(config: Any) -> None:
    """The model's sizes and choices (variant filled in, heads dividing the width, norm names and
    override keys), as the loop will resolve them; imports flax, not a JAX backend."""
    from normvit_jax import models
    from normvit_jax.norms import registry
    spec = models.spec_of(config.model, num_classes=2)
    # each norm's options (ranges, None, unknown keys) as building it checks them, no building
    for norm in {spec.norm, *getattr(spec, "slot_norms", ()),
                 *(n for n in (getattr(spec, "stem_norm", None),) if n)}:
        registry.checked_options(norm)


def check_run_length(config: Any) -> None:
    """total_steps (None or >= 1) and num_epochs (> 0): 0 or negative values used to train the
    whole run, a single step or nothing, all with exit 0."""
    steps = config.total_steps
    if steps is not None and (isinstance(steps, bool) or int(steps) != steps or steps < 1):
        raise ValueError(f"config.total_steps={steps!r} must be None (use num_epochs) or an "
                         "integer >= 1")
    epochs = config.num_epochs
    if (epochs is None and steps is None) or (epochs is not None and not epochs > 0):
        raise ValueError(f"config.num_epochs={epochs!r} must be > 0 (or set config.total_steps)")


def check_workdir_path(workdir: str) -> None:
    if not str(workdir).strip():  # os.path.abspath('') is the current folder
        raise ValueError("the workdir is empty (an unset shell variable?); pass the run's "
                         "directory, e.g. --workdir=runs/demo")
    if workdir_lib.is_remote(workdir):
        return
    path = os.path.abspath(workdir)
    problem = workdir_lib.not_a_folder(path)
    if problem and problem.startswith("is a symbolic link"):
        raise workdir_lib.WorkdirError(f"the workdir {path} {problem}; pass another --workdir")
    probe = path
    while probe and not os.path.exists(probe):  # the nearest existing ancestor must be a folder
        probe = os.path.dirname(probe) if os.path.dirname(probe) != probe else ""
    if probe and not os.path.isdir(probe):
        what = "the workdir" if probe == path else f"the workdir's parent {probe}"
        raise workdir_lib.WorkdirError(
            f"{what} is a file, not a directory ({path}); pass another --workdir")


def npz_problem(head: bytes) -> str | None:
    """None if ``head`` (the first bytes of a file) starts an .npz archive, else what it is."""
    if head.startswith(ZIP_MAGIC):
        return None
    if head.startswith(NPY_MAGIC):
        return "a single .npy array, not an .npz archive of parameters"
    if not head:
        return "an empty file, not an .npz archive"
    if len(head) > 8 and head[8:9] == b"{" and 1 < int.from_bytes(head[:8], "little") < 10**9:
        return ("a .safetensors file (a PyTorch state dict), not an .npz archive: name it "
                "FILE.safetensors to load it (docs/pretrained.md)")
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a pickle, not an .npz archive; refusing to load it"
    return ("not an .npz archive (it does not start with the zip signature 'PK'; truncated, an "
            f"HTML error page, or another format? {ACCEPTED[1:-1]})")


def _ema_hint(workdir: str) -> str:
    """For a run with a weight EMA: the export flag that writes it (export takes the raw weights
    unless told), so the user picks the model that evaluated better."""
    try:
        saved = run_config.read_saved(epath.Path(workdir) / "config.json")
        decay = float(saved.get("ema_decay") or 0)
    except (OSError, ValueError, TypeError, AttributeError):  # no or a damaged config: no hint
        return ""
    return (f"; the run keeps a weight EMA (config.ema_decay={decay:g}): add --weights=ema to "
            "export it instead of the raw weights") if decay > 0 else ""


def check_npz(path: str, key: str = "path", missing_hint: str = "") -> None:
    """A local file that exists, is readable and starts like an .npz (zip) archive;
    ``missing_hint`` ends the message of a file that does not exist (what to do)."""
    p = epath.Path(path)
    if not p.exists():
        if str(path).startswith("~"):
            missing_hint = " (a '~' is not expanded here: give the full path)"
        raise ValueError(f"{key}={path!r} does not exist{missing_hint}")
    if p.is_dir():
        raise ValueError(f"{key}={path!r} " + _folder_problem(str(path)))
    try:
        with p.open("rb") as f:
            head = f.read(16)
    except OSError as e:
        raise ValueError(f"{key}={path!r} cannot be read ({type(e).__name__}: {e})") from None
    if str(path).lower().endswith(".onnx"):
        raise ValueError(f"{key}={path!r}: an .onnx file, not a checkpoint {ACCEPTED}: pass the "
                         "weights the model was exported from (an ONNX graph is not read back)")
    problem = npz_problem(head)
    if problem:
        raise ValueError(f"{key}={path!r}: {problem}")


def _export_hint(workdir: str, step: str | None = None) -> str:
    return (f"`python -m normvit_jax.export --workdir={workdir}"
            + (f" --step={step}" if step else "") + " --out=FILE.npz` writes its weights as an .npz "
            "to pass here (docs/pretrained.md)" + _ema_hint(workdir))


def _folder_problem(path: str) -> str:
    """What to pass instead of the folder ``path``: a run of this project (its workdir, or one of
    its checkpoint folders) goes through its export; a folder holding a weights file (an HF hub
    folder) names that file."""
    if run_config.has_checkpoint(path):  # a run of this project: say how to start from it
        return f"is a directory, not a checkpoint file; it holds a run: {_export_hint(path)}"
    p = os.path.normpath(path)
    parent, name = os.path.dirname(p), os.path.basename(p)
    if name == "checkpoints" and run_config.has_checkpoint(parent):
        return f"is a folder of the run {parent}: {_export_hint(parent)}"
    grand = os.path.dirname(parent)
    if (os.path.basename(parent) == "checkpoints" and name.split(".")[0].isdigit()
            and run_config.has_checkpoint(grand)):
        return f"is a folder of the run {grand}: {_export_hint(grand, name.split('.')[0])}"
    try:
        inside = sorted(f for f in os.listdir(p) if f.lower().endswith(INIT_SUFFIXES)
                        and os.path.isfile(os.path.join(p, f)))
    except OSError:
        inside = []
    pick = next((f for f in WEIGHT_FILES if f in inside), inside[0] if inside else None)
    hint = f": pass the weights file in it, --config.init_from={os.path.join(p, pick)}" if pick else ""
    return f"is a directory, not a checkpoint file {ACCEPTED}{hint}"


def check_gcs_credentials(path: str, what: str = "the workdir") -> None:
    """Fails at once (WorkdirError, exit 5) when a gs:// ``path`` has no Google Cloud credentials:
    without any, GCS clients retry for minutes or end in a long TensorFlow traceback. ``what``
    names the setting that holds ``path``. Asks ``google.auth.default()`` when google-auth is
    installed, else looks where it would (offline: no network call)."""
    if not path.startswith("gs://"):
        return
    problem = credentials_problem()
    if problem:
        public = ""
        if path.startswith(PUBLIC_WEIGHTS):  # Google's public bucket: no credentials over https
            public = (f" Or download the public file, `wget https://storage.googleapis.com/"
                      f"{path[len('gs://'):]}`, and pass its local path: "
                      f"--{what}={os.path.basename(path)}.")
        raise workdir_lib.WorkdirError(
            f"{what} {path}: no Google Cloud credentials found ({problem}). Run `gcloud auth "
            "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a service-account "
            f"key, or run on a Cloud VM.{public}")


PUBLIC_WEIGHTS = "gs://vit_models/"  # configs/finetune_cifar.py's checkpoints: readable by anyone


def credentials_problem() -> str | None:
    """None when Google Cloud credentials are available, else why not."""
    try:
        import google.auth  # pylint: disable=import-outside-toplevel
        from google.auth import exceptions  # pylint: disable=import-outside-toplevel
    except ImportError:
        return _credentials_problem_without_google_auth()
    try:
        google.auth.default()
    except exceptions.DefaultCredentialsError as e:
        return str(e).strip().splitlines()[0]
    return None


def _credentials_problem_without_google_auth() -> str | None:
    """google.auth.default()'s sources, without the library: a key file, gcloud's application
    default credentials, or a Cloud VM (its metadata server; recognised by its DMI product name)."""
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key and os.path.exists(key):
        return None
    gcloud = os.environ.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
    if os.path.exists(os.path.join(gcloud, "application_default_credentials.json")):
        return None
    try:
        with open(GCE_PRODUCT_FILE) as f:
            if f.read().startswith("Google"):
                return None
    except OSError:
        pass
    return (f"GOOGLE_APPLICATION_CREDENTIALS is {'set to a missing file' if key else 'unset'}, "
            f"no application default credentials in {gcloud}, not a Google Cloud VM")
