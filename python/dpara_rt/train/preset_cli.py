"""The command line every preset shares: its run options, the command its manifest records, errors as one line."""
from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Callable


def manifest_head(fmt: str, command: str | None, regenerate_with: str, threads: int, **environment) -> dict:
    """A preset manifest's first keys: its format, the command that made it, how to make it again, when, and the
    environment (python, torch, machine, threads, plus `environment`)."""
    import torch

    return {"format": fmt, "command": command or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "regenerate_with": regenerate_with, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "machine": platform.machine(), "threads": threads, **environment}}


def preset_parser(module: str, description: str, out_default: str, threads: int) -> argparse.ArgumentParser:
    """A preset's parser with --out, --threads, --work-dir and --resume; the preset adds its budgets."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    p.add_argument("--out", default=out_default, help=f"output directory (default: {out_default})")
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--work-dir", default=None, help="checkpoints (default: a folder under $TMPDIR)")
    p.add_argument("--resume", action="store_true", help="continue from the work directory's checkpoints")
    return p


def run_preset(p: argparse.ArgumentParser, argv, run: Callable[[argparse.Namespace, str], object]) -> int:
    """Parse argv (default: the process's), call run(args, command) with the command line the manifest records;
    0, or 2 with one line on a ValueError, RuntimeError or FileNotFoundError."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    try:
        run(args, shlex.join([*p.prog.split(), *argv]))
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["manifest_head", "preset_parser", "run_preset"]
