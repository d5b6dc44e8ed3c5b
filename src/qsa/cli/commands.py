"""The ``qsa`` command: ``info``, ``demo``, ``verify``, ``bench`` and ``--version``."""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys


def info(args) -> int:
    import numpy
    import torch
    import triton

    from .. import __version__, backend
    from ..utils import device_facts, interpreter_enabled

    print(f"qsa {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"numpy {numpy.__version__}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    facts = device_facts(str(device))
    if device.type == "cuda":
        cap = facts["capability"]
        print(f"device: {facts['name']} (cuda), compute capability {cap[0]}.{cap[1]}, "
              f"{facts['sm_count']} SMs, {facts['shared_memory_per_block_optin'] // 1024} KiB shared "
              f"memory per block, {facts['total_memory'] / 2**30:.0f} GiB")
    else:
        print(f"device: cpu ({os.cpu_count()} cores), Triton interpreter "
              f"{'on' if interpreter_enabled() else 'off (TRITON_INTERPRET=1 turns it on)'}")
    no_triton = backend.triton_available(device)
    for route in ("grouped", "xqa", "splitk", "invariant", "reference"):
        ok = route == "reference" or no_triton is None
        why = "" if ok else f" ({no_triton})"
        print(f"route {route:9s} {'supported' if ok else 'unavailable'}{why}")
    return 0


COMMANDS = {
    "demo": ("qsa.cli.demo", "run the tiny QSA model twice with different page placements, compare the logits"),
    "verify": ("qsa.cli.verify", "replay a step under relocations, permutations and CUDA graphs, compare bitwise"),
    "bench": ("benchmarks.run", "run the benchmark suite (from a source checkout)"),
}
"""Subcommands with options of their own: module, one line of help. They get the rest of the command
line untouched (``qsa <command> --help`` prints their options)."""


def _run_module(module: str, argv: list) -> int:
    if module.startswith("benchmarks."):
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # src/qsa/cli/
        if not os.path.isdir(os.path.join(root, "benchmarks")):
            print("qsa bench runs from a source checkout (benchmarks/ next to src/)", file=sys.stderr)
            return 2
        sys.path.insert(0, root)
    return importlib.import_module(module).main(argv)


def build_parser() -> argparse.ArgumentParser:
    """The ``qsa`` parser: ``--version``, and every subcommand with its line of help."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="qsa", description="QSA sparse paged attention kernels: checks, demo and benchmarks.",
        epilog="Run 'qsa <command> --help' for the options of a command.")
    parser.add_argument("--version", action="version", version=f"qsa {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="<command>")
    sub.add_parser("info", help="print versions, the device and the routes it supports",
                   description="Print the versions of qsa, Python, torch, triton and numpy, the device and "
                               "the routes it supports.").set_defaults(func=info)
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Subcommands with options of their own get the rest of the command line untouched.
    if argv and argv[0] in COMMANDS:
        return _run_module(COMMANDS[argv[0]][0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `qsa`: what it can do
        parser.print_help()
        return 0
    return args.func(args)

