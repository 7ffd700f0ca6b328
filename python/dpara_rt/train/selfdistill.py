"""Training prompts a chat target makes for itself, from sources the package ships or the machine has:

* user turns the target writes through its own chat template, asked for a question, a math word problem
  or a programming request about a topic drawn from the lists below;
* code headers (a function's signature and docstring) cut from the Python standard library's sources,
  given raw (plain completion) and inside a chat request.

Held-out prompts come from their own topics and stdlib modules, so no held-out prompt shares a source
with a training prompt. :func:`eval_prompt_texts` reads the evaluation sets, which training must not see.
"""
from __future__ import annotations

import ast
import json
import random
import sysconfig
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

KINDS = ("chat", "math", "code_chat", "code_raw")

CHAT_TOPICS = [
    "the ocean tides", "volcanoes", "the history of paper", "how bees make honey", "learning a new language",
    "saving money", "the water cycle", "sleep and memory", "ancient Egypt", "electric cars", "gardening tomatoes",
    "the solar system", "how vaccines work", "writing a cover letter", "chess openings", "the Roman empire",
    "recycling plastic", "baking bread", "rainforests", "the human heart", "public speaking", "climate and weather",
    "the printing press", "photography basics", "healthy breakfast ideas", "how airplanes fly", "coral reefs",
    "time management", "the Moon landing", "making friends in a new city", "dinosaurs", "renewable energy",
    "caring for a puppy", "the French revolution", "how the internet works", "meditation", "black holes",
    "packing for a trip", "the history of jazz", "earthquakes", "writing a short story", "mushrooms",
    "the Great Wall of China", "how batteries work", "running a first marathon", "penguins", "the stock market",
    "composting", "the immune system", "learning to draw", "glaciers", "the Silk Road", "birthday party planning",
    "how rainbows form", "octopuses", "the invention of the telephone", "job interviews", "desert animals",
    "the history of the Olympic games", "how to study for exams", "wind turbines", "the Renaissance",
    "houseplants", "bird migration", "first aid for a burn", "the metric system", "fairy tales", "honeybee decline",
]
MATH_TOPICS = [
    "buying apples at a market", "a train journey", "sharing pizza slices", "saving pocket money", "painting a fence",
    "a school bake sale", "filling a swimming pool", "a bicycle race", "buying notebooks", "a garden's area",
    "sharing marbles", "a recipe for cookies", "a bookshop discount", "walking to school", "a farmer's chickens",
    "a concert ticket price", "a car's fuel use", "stacking boxes", "a class field trip", "a phone plan",
    "a bakery's daily bread", "saving for a bicycle", "a bus timetable", "a lemonade stand", "planting trees",
    "tiling a floor", "a library's books", "a running track", "a birthday cake's candles", "a fruit basket",
    "an aquarium's fish", "a parking lot", "a hiking trail", "a toy store sale",
]
CODE_TOPICS = [
    "reading a CSV file", "sorting a list of dictionaries", "string formatting", "recursion", "list comprehensions",
    "handling exceptions", "reading JSON", "counting word frequencies", "working with dates", "regular expressions",
    "writing a class", "binary search", "generators", "unit tests", "reversing a string", "finding duplicates in "
    "a list", "merging two dictionaries", "a stack data structure", "file paths", "command line arguments",
    "checking for prime numbers", "Fibonacci numbers", "removing whitespace", "matrix multiplication",
    "a simple web request", "flattening nested lists", "decorators", "sets", "a queue", "random numbers",
    "palindromes", "converting temperatures", "a linked list", "lambda functions", "zip and enumerate",
]
INSTRUCTIONS = {
    "chat": "Write one question that a curious person might ask an AI assistant about {topic}. "
            "Reply with the question only.",
    "math": "Write one short math word problem about {topic} that takes a few steps of arithmetic to solve. "
            "Reply with the problem only.",
    "code_chat": "Write one request a beginner programmer might make to an AI assistant about {topic} in Python. "
                 "Reply with the request only.",
}
TOPICS = {"chat": CHAT_TOPICS, "math": MATH_TOPICS, "code_chat": CODE_TOPICS}
CODE_REQUEST = "Complete this Python function:\n\n```python\n{header}```"


@dataclass(frozen=True)
class Prompt:
    kind: str      # one of KINDS
    text: str      # a user turn (chat template applied at encoding) or, for code_raw, raw text
    source: str    # the topic or stdlib module it came from
    split: str     # "train" or "heldout"

    def encode(self, tokenizer) -> list[int]:
        return tokenizer.encode(self.text) if self.kind == "code_raw" else tokenizer.encode_chat(self.text)


def split_sources(sources: Sequence[str], heldout_share: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, held-out) sources: a seeded shuffle, the first ``heldout_share`` of them held out."""
    order = sorted(set(sources))
    random.Random(seed).shuffle(order)
    cut = max(1, round(len(order) * heldout_share))
    return sorted(order[cut:]), sorted(order[:cut])


def question_requests(kind: str, topics: Sequence[str], count: int, seed: int) -> list[tuple[str, str]]:
    """``count`` (topic, instruction) pairs, topics cycled in a seeded order."""
    if kind not in INSTRUCTIONS:
        raise ValueError(f"kind={kind!r}: expected one of {sorted(INSTRUCTIONS)}")
    if not topics:
        raise ValueError(f"no topics for {kind} requests")
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        order = list(topics)
        rng.shuffle(order)
        out += [(t, INSTRUCTIONS[kind].format(topic=t)) for t in order]
    return out[:count]


def clean_user_turn(text: str) -> str | None:
    """The first paragraph of what the target wrote, without quotes or a label; None if too short or too long."""
    text = text.strip().split("\n\n")[0].strip()
    for label in ("Question:", "Problem:", "Request:", "Q:"):
        if text.startswith(label):
            text = text[len(label):].strip()
    text = text.strip('"\'“” ')
    return text if 12 <= len(text) <= 400 else None


def write_user_turns(generate, tokenizer, requests: Sequence[tuple[str, str]], kind: str, split: str,
                     exclude: Iterable[str] = ()) -> list[Prompt]:
    """Ask the chat target to write a user turn per request; ``generate(prompts) -> new token lists``.
    Drops empty, duplicate and excluded (evaluation) texts."""
    outs = generate([tokenizer.encode_chat(instr) for _, instr in requests])
    seen, prompts = set(exclude), []
    for (topic, _), ids in zip(requests, outs):
        text = clean_user_turn(tokenizer.decode(ids))
        if text is not None and text not in seen:
            seen.add(text)
            prompts.append(Prompt(kind, text, topic, split))
    return prompts


def stdlib_modules(root: str | Path | None = None) -> dict[str, Path]:
    """{module name: source file} of the standard library's top-level pure-Python modules (no tests)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    mods = {}
    for path in sorted(root.glob("*.py")):
        if not path.name.startswith(("_", "test")):
            mods[path.stem] = path
    for path in sorted(root.glob("*/__init__.py")):
        name = path.parent.name
        if not name.startswith(("_", "test", "idlelib", "lib2to3", "site-packages")):
            mods[name] = path
    return mods


def code_headers(path: Path, max_chars: int = 700) -> list[str]:
    """Signature + docstring of each documented top-level function and method in ``path``, dedented and
    ending with a newline (where the body would start)."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, OSError):
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        body = node.body
        if not (body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)) or len(body) < 2:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        header = textwrap.dedent("\n".join(lines[start - 1:body[0].end_lineno])) + "\n"
        if len(header) <= max_chars:
            out.append(header)
    return out


def code_prompts(modules: dict[str, Path], count: int, split: str, seed: int,
                 exclude: Iterable[str] = ()) -> list[Prompt]:
    """``count`` code prompts from headers of ``modules``, alternating raw completions and chat requests."""
    headers = [(name, h) for name in sorted(modules) for h in code_headers(modules[name])]
    if not headers:
        raise ValueError(f"no documented functions found in modules {sorted(modules)[:8]}...")
    rng = random.Random(seed)
    rng.shuffle(headers)
    excluded, out = set(exclude), []
    for i, (name, header) in enumerate(headers):
        if len(out) >= count:
            break
        kind = "code_raw" if i % 2 == 0 else "code_chat"
        text = header if kind == "code_raw" else CODE_REQUEST.format(header=header)
        if text not in excluded:
            out.append(Prompt(kind, text, name, split))
    return out


def eval_prompt_texts(root: str | Path) -> set[str]:
    """Every string in the evaluation sets ``root/*.jsonl`` (prompts, messages' contents, ...): training
    prompts must equal none of them."""
    texts: set[str] = set()

    def walk(v):
        if isinstance(v, str):
            texts.add(v)
            texts.add(v.strip())
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for path in sorted(Path(root).glob("*.jsonl")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    walk(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"evaluation set {path} line {n} is not JSON: {e}") from None
    return texts


def save_prompts(prompts: Sequence[Prompt], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")


def load_prompts(path: str | Path) -> list[Prompt]:
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        try:
            p = Prompt(**json.loads(line))
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path} line {n}: expected a JSON prompt record with kind, text, source, split ({e})")
        if p.kind not in KINDS or p.split not in ("train", "heldout"):
            raise ValueError(f"{path} line {n}: kind={p.kind!r}, split={p.split!r}; expected a kind in {KINDS} "
                             "and split 'train' or 'heldout'")
        out.append(p)
    return out
