"""The configuration reference (docs/configuration.md), generated from the argparse parsers so it
cannot drift from the code: one table per command, every flag with its default and its help.

    python -m pdserve.entrypoints.docs_reference --write docs/configuration.md   # regenerate
    python -m pdserve.entrypoints.docs_reference --check docs/configuration.md   # exit 1 when it differs

tests/test_docs_reference.py runs the check.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from pdserve.entrypoints.cli import build_parser
from pdserve.loadgen.cli import build_parser as build_bench_parser
from pdserve.loadgen.plot import build_plot_parser

HEADER = """\
# Configuration reference

Every flag of every `pdserve` command, generated from the command-line parsers by
`python -m pdserve.entrypoints.docs_reference --write docs/configuration.md`; a test fails when this page
and the parsers disagree. The other pages explain what the flags are for and link here;
[Coming from vLLM](from-vllm.md) maps `vllm serve`'s flags to `pdserve serve`'s.

`pdserve COMMAND --help` prints the same list. Environment variables read by pdserve:
`PDSERVE_API_KEY` (the default of `--api-key`), `PDSERVE_CACHE_DIR` (where `builtin:` models and
the compiled CPU kernels are written, default `~/.cache/pdserve`), `PDSERVE_NATIVE_KERNELS` (`0`:
run the numba kernels and the Python layers instead of compiling `pdserve/kernels/native_gemv.c`
and `native_decode.c`), `PDSERVE_NATIVE_ISA` (`avx2`: build those kernels for AVX2 on an AVX-512
CPU too, to test that path; default `native`), `PDSERVE_CPU_GEMM_DTYPE` (what `--cpu-gemm-dtype auto` means, where set:
`float32` or `bfloat16`), `LMCACHE_CONFIG_FILE` (the default of `--lmcache-config`).
"""

# Defaults computed on the machine that builds the parser, written as the rule instead.
MACHINE_DEFAULTS = {"--kv-transfer": "nixl when NIXL imports, else store"}


def command_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command, parser) for `pdserve` and each subcommand, in the order `pdserve --help` lists them."""
    own_parsers: dict[str, Callable[[], argparse.ArgumentParser]] = {
        "bench": build_bench_parser, "bench-plot": build_plot_parser}  # the CLI hands these argv over
    root = build_parser()
    found = [("pdserve", root)]
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((f"pdserve {name}", own_parsers[name]() if name in own_parsers else sub))
    return found


def command_help(root: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's one-line help, as `pdserve --help` shows it."""
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {f"pdserve {c.dest}": c.help or "" for c in action._choices_actions}
    return {}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.choices is not None:
        names += " {" + ", ".join(f"`{c}`" for c in action.choices) + "}"
    elif action.metavar and action.option_strings:
        names += f" `{action.metavar}`"
    return names


def _default(action: argparse.Action) -> str:
    if not action.option_strings:
        return "required" if action.nargs in (None, "+") else "(none)"
    for name in action.option_strings:
        if name in MACHINE_DEFAULTS:
            return MACHINE_DEFAULTS[name]
    if action.required:
        return "required"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "(none)" if action.default is None else "on" if action.default else "off"
    if action.nargs == 0:
        return "off"
    if action.default is None or action.default == []:
        return "(none)"
    return f"`{action.default}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    return _cell(parser._get_formatter()._expand_help(action))


def command_section(name: str, summary: str, parser: argparse.ArgumentParser) -> str:
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        rows.append(f"| {_flag(action)} | {_cell(_default(action))} | {_help(parser, action)} |")
    lines = [f"## `{name}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ".", ""]
    return "\n".join(lines + rows) + "\n"


def render() -> str:
    parsers = command_parsers()
    summaries = command_help(parsers[0][1])
    summaries["pdserve"] = "options before the command; `pdserve --version` prints the version"
    sections = [command_section(name, summaries.get(name, ""), parser) for name, parser in parsers]
    return HEADER + "\n" + "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.entrypoints.docs_reference", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", help="write the reference to FILE")
    mode.add_argument("--check", metavar="FILE", help="exit 1 when FILE differs from the parsers")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        Path(args.write).write_text(text)
        return 0
    if Path(args.check).read_text() != text:
        print(f"{args.check} is out of date: python -m pdserve.entrypoints.docs_reference --write {args.check}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
