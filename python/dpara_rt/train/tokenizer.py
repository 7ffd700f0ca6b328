"""The embedded model's tokenizer: byte-level BPE trained on the running interpreter's standard library.

Corpus rule (documented in the manifest as ``corpus.rule``): every ``*.py`` file under
``sysconfig.get_paths()['stdlib']``, except files inside a directory named ``site-packages``,
``dist-packages``, ``test``, ``tests``, ``idle_test`` or ``__pycache__`` (installed packages and test
suites), and except the top-level packages ``idlelib`` (a GUI application), ``pydoc_data`` (generated
help text), ``encodings`` (generated codec tables) and ``turtledemo``. Files that are not valid UTF-8
are skipped and counted. Files are taken in sorted order of their POSIX relative path; a file is held
out when the first 8 hex digits of sha256(relative path) fall in the lowest ``HELDOUT_PERCENT`` percent,
so the split depends only on the file's name, never on the machine or on the order of discovery.

The BPE is trained on the training split only, with a byte-level pre-tokenizer and decoder so that any
text (any Unicode, any whitespace) round-trips exactly through encode/decode.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
DEFAULT_VOCAB_SIZE = 8192
VOCAB_RANGE = (4096, 16384)
HELDOUT_PERCENT = 5
EXCLUDED_DIR_NAMES = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
EXCLUDED_TOP_LEVEL = frozenset({"idlelib", "pydoc_data", "encodings", "turtledemo"})
TOKENIZER_FILE = "tokenizer.json"


def corpus_rule() -> str:
    """The file-selection rule in one line, for the manifest."""
    return (f"*.py under sysconfig stdlib; skip dirs named {sorted(EXCLUDED_DIR_NAMES)}, top-level "
            f"{sorted(EXCLUDED_TOP_LEVEL)}, non-UTF-8 files; sorted by relative path; held out when "
            f"int(sha256(relpath)[:8], 16) % 100 < {HELDOUT_PERCENT}")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


@dataclass
class Corpus:
    """The stdlib documents of each split as (relative path, text), in sorted path order."""
    root: str
    train: list[tuple[str, str]] = field(default_factory=list)
    heldout: list[tuple[str, str]] = field(default_factory=list)
    skipped_non_utf8: list[str] = field(default_factory=list)

    def texts(self, split: str) -> list[str]:
        return [text for _, text in self._split(split)]

    def _split(self, split: str) -> list[tuple[str, str]]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split {split!r}: expected 'train' or 'heldout'")
        return self.train if split == "train" else self.heldout

    def stats(self) -> dict:
        out = {"python_version": platform.python_version(), "python_implementation": platform.python_implementation(),
               "rule": corpus_rule(), "skipped_non_utf8": len(self.skipped_non_utf8)}
        for split in ("train", "heldout"):
            docs = self._split(split)
            out[split] = {"files": len(docs), "bytes": sum(len(t.encode()) for _, t in docs)}
        return out


def load_stdlib_corpus(root: str | os.PathLike | None = None) -> Corpus:
    """Collect the corpus by the module rule from ``root`` (default: this interpreter's stdlib)."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"stdlib root {str(root)!r} is not a directory; expected the Python standard library")
    corpus = Corpus(str(root))
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        parts = path.relative_to(root).parts
        if EXCLUDED_DIR_NAMES.intersection(parts[:-1]) or parts[0] in EXCLUDED_TOP_LEVEL or not path.is_file():
            continue
        rel = "/".join(parts)
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            corpus.skipped_non_utf8.append(rel)
            continue
        (corpus.heldout if is_heldout(rel) else corpus.train).append((rel, text))
    if not corpus.train or not corpus.heldout:
        raise ValueError(f"stdlib root {str(root)!r} gave {len(corpus.train)} training and {len(corpus.heldout)} "
                         "held-out files; expected both splits to be non-empty")
    return corpus


class CodeTokenizer:
    """A thin wrapper over a `tokenizers.Tokenizer` with the EOS id and exact byte-level round trips."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        eos = tokenizer.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"tokenizer has no {EOS_TOKEN!r} token; expected one trained by dpara_rt")
        self.eos_token_id: int = eos
        self.pad_token_id: int | None = tokenizer.token_to_id(PAD_TOKEN)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        # keep special tokens so that encode -> decode is the identity even for text containing them
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        self._tok.save(os.fspath(path))

    def to_str(self) -> str:
        return self._tok.to_str()

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "CodeTokenizer":
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist; expected a tokenizer.json")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
            raise ValueError(f"tokenizer file {str(path)!r} cannot be read: {e}") from None


def train_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2) -> CodeTokenizer:
    """Byte-level BPE over ``texts`` with ``SPECIAL_TOKENS`` (EOS first, id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lo, hi = VOCAB_RANGE
    if not lo <= vocab_size <= hi:
        raise ValueError(f"vocab_size={vocab_size}: expected {lo} <= vocab_size <= {hi}")
    if not texts:
        raise ValueError("train_tokenizer needs at least one text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    return CodeTokenizer(tok)


def encode_documents(tokenizer: CodeTokenizer, texts: Sequence[str]) -> torch.Tensor:
    """One token stream: every document followed by EOS (so the model learns where files end)."""
    stream: list[int] = []
    for ids in tokenizer.encode_batch(texts):
        stream += ids
        stream.append(tokenizer.eos_token_id)
    return torch.tensor(stream, dtype=torch.long)


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    corpus: Corpus | None = None) -> tuple[CodeTokenizer, dict[str, torch.Tensor], dict]:
    """Train the tokenizer on the stdlib training split, save ``out_dir/tokenizer.json`` and return
    (tokenizer, {"train": stream, "heldout": stream}, corpus statistics with token counts)."""
    corpus = load_stdlib_corpus() if corpus is None else corpus
    tokenizer = train_tokenizer(corpus.texts("train"), vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out_dir / TOKENIZER_FILE)
    return (tokenizer, *corpus_streams(tokenizer, corpus))


def corpus_streams(tokenizer: CodeTokenizer, corpus: Corpus | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """({"train": stream, "heldout": stream}, corpus statistics with token counts) under ``tokenizer``."""
    corpus = load_stdlib_corpus() if corpus is None else corpus
    streams = {split: encode_documents(tokenizer, corpus.texts(split)) for split in ("train", "heldout")}
    stats = corpus.stats()
    for split, stream in streams.items():
        stats[split]["tokens"] = int(stream.numel())
        stats[split]["bytes_per_token"] = round(stats[split]["bytes"] / stream.numel(), 3)
    stats["vocab_size"] = tokenizer.vocab_size
    return streams, stats
