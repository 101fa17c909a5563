"""Command-line flags of the ``python -m`` tools (benchmarks, analysis, reparam), parsed by absl
as main.py's are: ``--name=value`` or ``--name value``, ``--flag``/``--noflag``, ``--flagfile``.

Each parser owns a fresh ``absl.flags.FlagValues``, so tools that share flag names (--model,
--batch) with different defaults can be built, parsed and called again in one process (the
tests call their ``main(argv)``). The definitions read like argparse's:

    p = tool_flags.Parser("python -m benchmarks.memory", __doc__)
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--scan", action="store_true")
    p.add_argument("workdirs", nargs="+")             # positional arguments, at most one such
    args = p.parse_args(argv)                         # argv without the program name
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable, Sequence

from absl import flags

Args = types.SimpleNamespace

_DEFINE: dict[Any, Callable[..., Any]] = {str: flags.DEFINE_string, int: flags.DEFINE_integer,
                                          float: flags.DEFINE_float}


class Parser:
    """An argparse-shaped front for absl flags: the subset the tools use."""

    def __init__(self, prog: str, description: str | None = None) -> None:
        self.prog = prog
        self.description = (description or "").strip()
        self._flags = flags.FlagValues()
        self._required: list[str] = []
        self._order: list[str] = []
        self._help: dict[str, str] = {}
        self._positional: tuple[str, str, str] | None = None  # (name, nargs, help)
        self._dest: dict[str, str] = {}

    def add_argument(self, name: str, *, default: Any = None, type: Any = str,  # noqa: A002
                     choices: Sequence[str] | None = None, action: str | None = None,
                     required: bool = False, nargs: str | None = None, help: str = "",  # noqa: A002
                     dest: str | None = None) -> None:
        if not name.startswith("--"):
            if self._positional is not None or nargs not in ("+", "*"):
                raise ValueError(f"positional {name!r}: one list (nargs '+' or '*') is supported")
            self._positional = (name, nargs, help)
            return
        flag = name[2:]
        if dest and dest != flag:  # e.g. --dry-run read as args.dry_run
            self._dest[flag] = dest
        self._order.append(flag)
        self._help[flag] = help
        if action == "store_true":
            flags.DEFINE_bool(flag, False, help, flag_values=self._flags)
        elif choices is not None:
            flags.DEFINE_enum(flag, default, list(choices), help, flag_values=self._flags)
        elif type in _DEFINE:
            _DEFINE[type](flag, default, help, flag_values=self._flags)
        else:
            raise ValueError(f"flag {name!r}: type {type!r} is not supported")
        if required:
            self._required.append(flag)

    def usage(self) -> str:
        pos = ""
        if self._positional:
            name, nargs, _ = self._positional
            pos = f" {name} [{name} ...]" if nargs == "+" else f" [{name} ...]"
        lines = [f"usage: {self.prog} [--flag=value ...]{pos}"]
        if self.description:
            lines += ["", self.description]
        if self._positional:
            lines += ["", "positional arguments:", f"  {self._positional[0]}: {self._positional[2]}"]
        lines += ["", "flags:"]
        for name in self._order:
            f = self._flags[name]
            shown = f"--[no]{name}" if f.boolean else f"--{name}"
            if getattr(f.parser, "enum_values", None):
                shown += f"=<{'|'.join(f.parser.enum_values)}>"
            notes = [self._help[name]]
            if f.default is not None and not (f.boolean and not f.default):
                notes.append(f"(default: {f.default!r})")
            if name in self._required:
                notes.append("(required)")
            lines.append(f"  {shown}: " + " ".join(n for n in notes if n))
        return "\n".join(lines)

    def _fail(self, message: str) -> None:
        print(f"{self.prog}: error: {message}\n(--help lists the flags)", file=sys.stderr)
        raise SystemExit(2)

    def parse_args(self, argv: Sequence[str] | None = None) -> Args:
        """Parses argv (default: sys.argv[1:]); --help/-h prints the flags and exits 0, a bad or
        missing flag prints the error and exits 2 (as argparse did)."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if any(a in ("--help", "-h", "--helpfull", "-help") for a in argv):
            print(self.usage())
            raise SystemExit(0)
        self._flags.unparse_flags()
        try:
            rest = self._flags([self.prog] + argv)[1:]
        except flags.Error as e:
            self._fail(str(e))
        missing = [f for f in self._required if self._flags[f].value is None]
        if missing:
            self._fail("required: " + ", ".join(f"--{f}" for f in missing))
        values = {self._dest.get(name, name): self._flags[name].value for name in self._flags}
        if self._positional:
            name, nargs, _ = self._positional
            if nargs == "+" and not rest:
                self._fail(f"at least one {name} is required")
            values[name] = rest
        elif rest:
            self._fail(f"unexpected arguments: {rest}")
        return Args(**values)


def parse(argv: Sequence[str] | None, define: Callable[[Parser], None], prog: str,
          description: str | None = None) -> Args:
    """One-call form: ``define(parser)`` adds the flags, then argv is parsed."""
    p = Parser(prog, description)
    define(p)
    return p.parse_args(argv)
