"""Command-line flags of the ``python -m`` tools (benchmarks, analysis, reparam, data.prepare):
plain ``argparse`` (``--name=value`` or ``--name value``; booleans are ``--flag``), with the
project's CLI contract for bad input: one line on stderr naming the flag, exit 2, no usage dump.

    p = tool_flags.Parser("python -m benchmarks.memory", __doc__)
    p.add_argument("--batch", type=int, default=128, help="global batch")
    args = p.parse_args(argv)                         # argv without the program name
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import tempfile
from typing import NoReturn, Sequence

# --weights of the tools that read a training workdir (predict, export, reparam, recalibrate,
# analysis.attention, analysis.report): timm's --use-ema, as a choice. The default is None, which
# is 'raw' with one log line when the run keeps an EMA (checkpoints.choose_weights).
WEIGHTS = ("raw", "ema")
WEIGHTS_HELP = ("raw: the trained weights (the default); ema: their moving average of a run with "
                "config.ema_decay > 0, with its averaged norm statistics when the run kept them "
                "(config.ema_batch_stats), as its eval/ema_* metrics")

_HOME_VALUE = re.compile(r"^(--[^=]+=)(~[^/]*(?:/.*)?)$")


def expand_home(argv: Sequence[str]) -> list[str]:
    """``--flag=~/path`` as ``--flag=$HOME/path``: the shell expands a leading ``~`` in
    ``--flag ~/path`` but not after ``=``, so ``--src=~/photos`` would reach a tool as a path
    relative to the current directory. Other arguments are returned as given."""
    out = []
    for a in argv:
        m = _HOME_VALUE.match(a)
        out.append(m.group(1) + os.path.expanduser(m.group(2)) if m else a)
    return out


# absl's help flags, and -h as argparse has it (absl took it for an unknown flag 'h', exit 2)
ABSL_HELP = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def absl_help(argv: Sequence[str]) -> None:
    """For the absl commands (main.py, ``python -m normvit_jax.export``), before their flags are
    parsed: ``--help``/``-h``/``--helpshort`` print the command's docstring and its own flags,
    ``--helpfull`` every flag, on stdout, and exit 0 as the argparse tools do. absl exits 1
    after its help, which docs/faults.md reads as a bug. Else returns."""
    args = list(argv[1:])
    args = args[:args.index("--")] if "--" in args else args
    asked = [a for a in args if a in ABSL_HELP]
    if not asked:
        return
    from absl import app  # pylint: disable=import-outside-toplevel  (the argparse tools need none)
    full = "--helpfull" in asked
    app.usage(shorthelp=not full, writeto_stdout=True)
    if not full:
        print("\nTry --helpfull to get a list of all flags.")
    sys.exit(0)


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (argparse names the flag in its one-line error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not accepted; accepted: an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer >= 0 (a count of warm-up rounds, where 0 means none)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not accepted; accepted: an integer >= 0")
    return value


def add_weights(parser: argparse.ArgumentParser) -> None:
    """The shared ``--weights=raw|ema`` flag (default None: raw, logged when the run has an EMA)."""
    parser.add_argument("--weights", default=None, choices=WEIGHTS, help=WEIGHTS_HELP)


def check_output(flag: str, path: str, folder: bool = False) -> None:
    """Before the work: ``--flag=path`` can be written as a file (or, ``folder``, a folder): it is
    of that kind if it exists, and a file can be made in the nearest folder that exists. Else a
    ValueError naming the flag (one line, exit 2 by cli.tool_errors), not a traceback after the
    work. gs:// paths are left to the write (checking them needs credentials). An empty path
    (``--out=$UNSET``) is refused: as a folder it was the current one, where analysis.attention
    wrote its files."""
    if not path.strip():
        raise ValueError(f"--{flag} is empty (an unset shell variable?); pass the path of "
                         f"{'a folder' if folder else 'a file'}")
    if "://" in path:
        return
    path = os.path.abspath(path)
    kind = "a folder" if folder else "a file"
    if os.path.exists(path) and os.path.isdir(path) != folder:
        raise ValueError(f"--{flag}={path} exists and is not {kind}; pass the path of {kind}")
    parent = path if os.path.isdir(path) else os.path.dirname(path)
    while not os.path.exists(parent):  # where the missing folders will be made
        parent = os.path.dirname(parent)
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        raise ValueError(f"--{flag}={path}: cannot write in {parent} ({type(e).__name__}: "
                         f"{e.strerror or e}); pass a writable path") from None


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written; a flag's default after its help unless the help already
    names one or there is none (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # `is`, not `in`: 0 == False hid a default of 0 (prepare's --seed)
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (argparse prints the whole usage)
    and that takes no abbreviated flags (``--bat`` is not ``--batch``)."""

    def __init__(self, prog: str, description: str | None = None) -> None:
        super().__init__(prog=prog, description=description, formatter_class=_Formatter,
                         allow_abbrev=False)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """Positional arguments may sit between flags (``report a --out=o b``); ``--flag=~/x``
        means ``$HOME/x`` (expand_home). A flag the tool does not have is named first, with the
        flag it most likely meant (argparse named only a missing required one when both were:
        ``--workdirr=w`` read 'the following arguments are required: --workdir')."""
        args = expand_home(sys.argv[1:] if args is None else args)
        unknown = [a for a in args if a.startswith("--") and a != "--"
                   and a.split("=", 1)[0] not in self._option_string_actions]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}"
                       f"{self._did_you_mean(unknown[0].split('=', 1)[0])}")
        return self.parse_intermixed_args(args, namespace)

    def _did_you_mean(self, flag: str) -> str:
        """' (did you mean --X?)' for the closest flag of this tool, else ''."""
        match = difflib.get_close_matches(flag, [s for s in self._option_string_actions
                                                 if s.startswith("--")], n=1, cutoff=0.6)
        return f" (did you mean {match[0]}?)" if match else ""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")
