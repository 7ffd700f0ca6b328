"""The `dpara-rt` command line: demo (the main job), generate, info, train, bench."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from dpara_rt.methods import VARIANTS, needs_drafter, variant


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: the user sees what was wrong
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(name):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v
    return parse


def _batch(text):
    v = _positive("--batch")(text)
    if v > 16:
        raise argparse.ArgumentTypeError(f"--batch must be at most 16, got {v}")
    return v


def _temperature(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature must be a number, got {text!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"--temperature must be a finite number >= 0 (0 = greedy), got {text}")
    return v


def _out_dir(path: str) -> str:
    """The output directory, created and proven writable before any work starts."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CliError(f"--out {path} is a file; expected a directory (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise CliError(f"--out {path} cannot be written ({e.strerror or e}); expected a writable directory") from None
    return path


def _load_pair(args):
    from dpara_rt.compare import load_pair
    if getattr(args, "target", None):
        from dpara_rt.models.drafter import load_drafter
        from dpara_rt.models.loader import load_qwen3
        target = load_qwen3(args.target)
        drafter = load_drafter(args.drafter, target) if args.drafter else None
        tokenizer = _hf_tokenizer(args.target)
        return tokenizer, target, drafter
    return load_pair(getattr(args, "models", None))


def _hf_tokenizer(path):
    from dpara_rt.train.tokenizer import CodeTokenizer
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        raise CliError(f"no tokenizer.json in {path}; expected a Hugging Face model directory")
    return CodeTokenizer.from_file(file)


def cmd_demo(args):
    from tqdm import tqdm

    from dpara_rt.compare import DEMO_METHODS, anatomy_png, humaneval_prompts, record, run_method, table
    out = _out_dir(args.out)
    tokenizer, target, drafter = _load_pair(args)
    prompts = humaneval_prompts(tokenizer, args.prompts)
    results = {}
    for name in DEMO_METHODS:
        with tqdm(total=len(prompts), desc=f"{name:<13}", unit="prompt", file=sys.stderr) as bar:
            results[name] = run_method(name, target, drafter, prompts, args.batch, args.max_new_tokens,
                                       progress=bar.update, d=args.d, temperature=args.temperature)
    rows = [record(res, results["ar"]) for res in results.values()]
    if args.temperature > 0:
        for r in rows:  # sampled outputs differ from ar's by design; losslessness is what the tests check
            r["identical_to_ar"] = None
    print(f"\nHumanEval, {len(prompts)} prompts, batch {args.batch}, d = {args.d}, temperature {args.temperature}, "
          f"max_new_tokens {args.max_new_tokens}\n")
    print(table(rows))
    if args.temperature == 0:
        same = all(r["identical_to_ar"] for r in rows)
        print(f"\ngreedy outputs identical to ar: {'yes, every method' if same else 'NO'}")
    with open(os.path.join(out, "demo.json"), "w") as f:
        json.dump(rows, f, indent=1)
    anatomy_png(rows, os.path.join(out, "anatomy.png"),
                f"Per-round anatomy (batch {args.batch}, d = {args.d})")
    print(f"wrote {os.path.join(out, 'demo.json')} and {os.path.join(out, 'anatomy.png')}")
    if args.temperature == 0 and not all(r["identical_to_ar"] for r in rows):
        return 1
    return 0


def cmd_generate(args):
    from dpara_rt.engine import Engine
    try:
        kw = variant(args.method)
    except ValueError as e:
        raise CliError(str(e)) from None
    tokenizer, target, drafter = _load_pair(args)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise CliError("the prompt encodes to no tokens; give some text")
    eng = Engine(target, drafter if needs_drafter(kw["method"]) else None, d=args.d, temperature=args.temperature,
                 seed=args.seed, max_batch=1, **kw)
    sys.stdout.write(args.prompt)
    done = []
    try:
        for new in eng.stream([ids], args.max_new_tokens):
            before = tokenizer.decode(done)
            done += new[0]
            sys.stdout.write(tokenizer.decode(done)[len(before):])
            sys.stdout.flush()
    except BaseException:
        print(flush=True)  # the error goes on a line of its own, after the partial output
        raise
    st = eng.last_stats
    print(f"\n\n[{eng.name}] {st.new_tokens} tokens in {st.wall_s:.2f} s ({st.tokens_per_s:.1f} tok/s), "
          f"tau {st.tau:.2f}, {st.rounds} rounds", file=sys.stderr)
    return 0


def cmd_info(args):
    import dpara_rt
    info = dpara_rt.build_info()
    print(json.dumps(info, indent=1))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    print(f"host lanes: {len(cores)} CPU core(s) {cores}; CUDA lanes: {info.get('cuda_devices', 0)} device(s)")
    from dpara_rt.assets import TINY_DIR, read_manifest
    m = read_manifest()
    size = sum(f["bytes"] for f in m["files"].values())
    print(f"embedded pair 'tiny' in {TINY_DIR}: {len(m['files'])} files, {size / 1e6:.1f} MB")
    for key in ("target", "drafter", "corpus"):
        if key in m:
            print(f"  {key}: {json.dumps(m[key])[:300]}")
    return 0


def cmd_train(args):
    if args.preset != "tiny":
        raise CliError(f"unknown preset {args.preset!r}; expected 'tiny'")
    from dpara_rt.train.preset_tiny import run_tiny_preset
    run_tiny_preset(args.out, target_minutes=args.target_minutes, drafter_minutes=args.drafter_minutes)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dpara-rt", description="DPara parallel speculative decoding runtime")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="compare every method on HumanEval prompts with the embedded pair")
    demo.add_argument("--prompts", type=_positive("--prompts"), default=16)
    demo.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=96)
    demo.add_argument("--batch", type=_batch, default=1)
    demo.add_argument("--temperature", type=_temperature, default=0.0)
    demo.add_argument("--d", type=_positive("--d"), default=7)
    demo.add_argument("--out", default="out/demo")
    demo.add_argument("--models", default=None, help="directory of the embedded pair (default: the package's)")
    demo.set_defaults(fn=cmd_demo)

    gen = sub.add_parser("generate", help="stream a completion of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--method", default="dpara", help=f"one of {', '.join(VARIANTS)}")
    gen.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=96)
    gen.add_argument("--temperature", type=_temperature, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--d", type=_positive("--d"), default=7)
    gen.add_argument("--target", help="a Hugging Face Qwen3 directory (default: the embedded pair)")
    gen.add_argument("--drafter", help="a dpara_rt drafter directory for --target")
    gen.add_argument("--models", default=None, help="directory of the embedded pair (default: the package's)")
    gen.set_defaults(fn=cmd_generate)

    info = sub.add_parser("info", help="build info, lanes, embedded models")
    info.set_defaults(fn=cmd_info)

    train = sub.add_parser("train", help="run the training recipes")
    train.add_argument("--preset", default="tiny")
    train.add_argument("--out", default=None, help="where to write the pair (default: the package's assets)")
    train.add_argument("--target-minutes", type=float, default=28.0)
    train.add_argument("--drafter-minutes", type=float, default=28.0)
    train.set_defaults(fn=cmd_train)

    sub.add_parser("bench", help="end-to-end benchmark grid: dpara-rt bench --out DIR [--quick] (see --help)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark owns its options (see bench/bench_e2e.py --help)
        from dpara_rt.bench_e2e import main as bench_main
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (CliError, ValueError, RuntimeError, OSError) as e:
        print(f"dpara-rt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
