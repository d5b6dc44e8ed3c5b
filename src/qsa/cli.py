"""The ``qsa`` command: ``info``, ``demo``, ``verify``, ``bench``."""

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

    from . import __version__, routes
    from .utils import device_facts, interpreter_enabled

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
    no_triton = routes.triton_available(device)
    for route in ("grouped", "xqa", "splitk", "invariant", "reference"):
        ok = route == "reference" or no_triton is None
        why = "" if ok else f" ({no_triton})"
        print(f"route {route:9s} {'supported' if ok else 'unavailable'}{why}")
    return 0


COMMANDS = {
    "demo": ("qsa.demo", "run the tiny QSA model twice with different page placements"),
    "verify": ("qsa.verify", "replay a step under relocations, permutations and CUDA graphs"),
    "bench": ("benchmarks.run", "benchmark scenarios (from a source checkout)"),
}


def _run_module(module: str, argv: list) -> int:
    if module.startswith("benchmarks."):
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
        if not os.path.isdir(os.path.join(root, "benchmarks")):
            print("qsa bench runs from a source checkout (benchmarks/ next to src/)", file=sys.stderr)
            return 2
        sys.path.insert(0, root)
    return importlib.import_module(module).main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Subcommands with options of their own get the rest of the command line untouched.
    if argv and argv[0] in COMMANDS:
        return _run_module(COMMANDS[argv[0]][0], argv[1:])
    parser = argparse.ArgumentParser(prog="qsa", description="QSA sparse paged attention kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, device, supported routes").set_defaults(func=info)
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=f"{text} (see qsa {name} --help)")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
