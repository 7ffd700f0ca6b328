"""Text in, text out: the target directory's tokenizer and chat template, streaming decode without broken
characters, stop ids and stop strings, and text that matches the Engine's tokens."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from dpara_rt.serving.text import StopStrings, TextError, TextGenerator, TextTokenizer, model_eos_ids

from engine_pairs import predictable_pair

VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_end|>", "<|im_start|>"]  # ids 0..3
EOS, PAD, IM_END, IM_START = range(4)
MULTIBYTE = "日本語 😀 ünïcödé ñ "
UNSEEN = "Ωμέγα 中文字符 🚀🎉 ąęł"  # not in the training text: byte-level pieces split these characters

# Qwen3's template, cut to what matters here: roles, the generation prompt, and enable_thinking.
QWEN3_LIKE_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def build_tokenizer():
    """A byte-level BPE with exactly VOCAB tokens: specials 0..3, <think>/</think> as the last two."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [Path(sysconfig.get_paths()["stdlib"], "json", "decoder.py").read_text(), MULTIBYTE * 20]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    return tok


def write_tokenizer(root: Path, template: str | None = QWEN3_LIKE_TEMPLATE, eos_token="<|im_end|>") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(root / "tokenizer.json"))
    cfg = {"eos_token": eos_token, "pad_token": {"content": "<|pad|>", "special": True}, "bos_token": None,
           "model_max_length": 512}
    if template is not None:
        cfg["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return TextTokenizer.from_dir(write_tokenizer(tmp_path_factory.mktemp("tok")))


def write_text_pair(root):
    """A tiny Qwen3 target (saved with save_qwen3, tokenizer beside it) and its drafter (save_drafter) under
    `root`: (target dir, drafter dir)."""
    from dpara_rt.models.drafter_io import save_drafter
    from dpara_rt.models.loader import save_qwen3

    target, drafter = predictable_pair(vocab=VOCAB, eos=EOS)
    save_qwen3(target, root / "target")
    write_tokenizer(root / "target")
    (root / "target" / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, IM_END]}))
    save_drafter(drafter, root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return write_text_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def generator(pair_dirs):
    return TextGenerator.load(*pair_dirs, method="dpara", d=4)


# ------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_from_dir_reads_special_tokens_and_eos(tokenizer, pair_dirs):
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|pad|>"}
    assert tokenizer.eos_ids == [IM_END]
    assert model_eos_ids(pair_dirs[0]) == [EOS, IM_END]
    assert TextTokenizer.from_dir(pair_dirs[0]).eos_ids == [EOS, IM_END]
    assert tokenizer.decode(tokenizer.encode(MULTIBYTE)) == MULTIBYTE


def test_tokenizer_errors_name_the_file(tmp_path):
    with pytest.raises(TextError, match="does not exist"):
        TextTokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TextError, match="tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)


def test_streaming_decode_never_emits_a_broken_character(tokenizer):
    text = "x = '" + MULTIBYTE + UNSEEN * 2 + "'"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # single tokens do split characters here
    for step in (1, 2, 3):
        dec = tokenizer.decoder()
        pieces = [dec.push(ids[i:i + step]) for i in range(0, len(ids), step)] + [dec.flush()]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == text


def test_streaming_decode_after_a_prompt_context(tokenizer):
    prompt, completion = tokenizer.encode("中文"), tokenizer.encode("字符 🚀 end")
    dec = tokenizer.decoder(prompt)
    out = "".join(dec.push([t]) for t in completion) + dec.flush()
    assert out == tokenizer.decode(completion)


# ------------------------------------------------------------------------------------------ chat
def test_chat_template_with_and_without_enable_thinking(tokenizer):
    base = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat("hi") == base
    assert tokenizer.apply_chat("hi", enable_thinking=True) == base
    assert tokenizer.apply_chat("hi", enable_thinking=False) == base + "<think>\n\n</think>\n\n"
    assert tokenizer.apply_chat([{"role": "user", "content": "hi"}], system="be brief") == \
        "<|im_start|>system\nbe brief<|im_end|>\n" + base
    ids = tokenizer.encode_chat("hi", enable_thinking=False)
    assert ids[0] == IM_START and tokenizer.token_to_id("<think>") in ids


def test_chat_template_renders_as_transformers_does(tokenizer):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "日本"}]
    for thinking in (None, True, False):
        extra = {} if thinking is None else {"enable_thinking": thinking}
        want, _ = render_jinja_template([messages], chat_template=QWEN3_LIKE_TEMPLATE, add_generation_prompt=True,
                                        **tokenizer.special_tokens, **extra)
        assert tokenizer.apply_chat(messages, enable_thinking=thinking) == want[0]


def test_chat_template_from_jinja_file_and_missing_template(tmp_path):
    root = write_tokenizer(tmp_path / "a", template=None)
    with pytest.raises(TextError, match="no chat template"):
        TextTokenizer.from_dir(root).apply_chat("hi")
    (root / "chat_template.jinja").write_text("{{ messages[0].content }}|{{ eos_token }}")
    assert TextTokenizer.from_dir(root).apply_chat("hi") == "hi|<|im_end|>"
    (root / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(TextError, match="does not compile"):
        TextTokenizer.from_dir(root).apply_chat("hi")
    (root / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(TextError, match="no system role"):
        TextTokenizer.from_dir(root).apply_chat("hi")


# ------------------------------------------------------------------------------------------ stop strings
@pytest.mark.parametrize("pieces, want", [
    (["hello wor", "ld STOP here"], "hello world "),
    (["abc S", "T", "OP def"], "abc "),            # split over three pieces
    (["no stop at all", " S"], "no stop at all S"),  # a held-back prefix that never completes is released
    (["xSTO", "Py"], "x"),
])
def test_stop_strings_split_across_pieces(pieces, want):
    s = StopStrings(["STOP", "zzz"])
    out, stopped = [], False
    for p in pieces:
        text, stopped = s.feed(p)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(s.flush())
    assert "".join(out) == want
    assert stopped == ("STOP" in "".join(pieces))


def test_stop_strings_hold_back_only_a_possible_prefix():
    s = StopStrings(["</answer>"])
    assert s.feed("the answer is 4</ans") == ("the answer is 4", False)
    assert s.feed("wer> trailing") == ("", True)
    assert s.hit == "</answer>"
    with pytest.raises(TextError, match="non-empty"):
        StopStrings([""])


# ------------------------------------------------------------------------------------------ generation
def _engine_tokens(generator, ids, n, **kw):
    """The Engine's own greedy tokens for `ids`, cut before the first stop id."""
    out = generator.engine.generate([ids], n, **kw).tokens[0]
    cut = next((i for i, t in enumerate(out) if t in generator.stop_ids), len(out))
    return out[:cut]


@pytest.mark.parametrize("prompt, chat", [("def f(x):", False), ("x", False), ("日本語?", True)])
def test_greedy_text_equals_decoding_the_engines_tokens(generator, prompt, chat):
    text = generator.generate_text(prompt, 40, chat=chat)
    ids = generator.prompt_ids(prompt, chat=chat)
    tokens = _engine_tokens(generator, ids, 40)
    assert generator.last_tokens == tokens
    assert text == generator.tokenizer.decode(tokens)
    assert generator.finish_reason == ("stop_id" if prompt == "x" else "length")  # "x" ends at the EOS id
    streamed = list(generator.generate_text(prompt, 40, chat=chat, stream=True))
    assert "".join(streamed) == text and all(streamed)
    assert generator.last_stats is not None and generator.last_stats.new_tokens >= len(tokens)


def test_ar_method_without_drafter_gives_the_same_text(pair_dirs, generator):
    ar = TextGenerator.load(pair_dirs[0], None, method="ar")
    assert ar.generate_text("def f(x):", 30) == generator.generate_text("def f(x):", 30)
    with pytest.raises(TextError, match="needs a drafter"):
        TextGenerator.load(pair_dirs[0], None, method="dpara")


def test_stop_ids_end_the_text(generator):
    ids = generator.prompt_ids("def f(x):")
    tokens = _engine_tokens(generator, ids, 30)
    assert len(tokens) >= 4, tokens
    stop = tokens[3]
    first = tokens.index(stop)
    text = generator.generate_text("def f(x):", 30, stop_ids=[stop])
    assert generator.finish_reason == "stop_id"
    assert generator.last_tokens == tokens[:first]
    assert text == generator.tokenizer.decode(tokens[:first])


def test_stop_string_ends_the_stream_and_is_not_returned(generator):
    full = generator.generate_text("def f(x):", 30)
    assert len(full) >= 6, full
    stop = full[3:6]
    want = full[:full.index(stop)]
    assert generator.generate_text("def f(x):", 30, stop=stop) == want
    assert generator.finish_reason == "stop_string"
    pieces = list(generator.generate_text("def f(x):", 30, stop=[stop, "never-there"], stream=True))
    assert "".join(pieces) == want
    # the engine is free again after the early stop
    assert generator.generate_text("def f(x):", 30) == full


def test_stop_string_split_across_rounds(generator):
    rounds = list(generator.generate_text("def f(x):", 30, stream=True))
    i = next(i for i in range(len(rounds) - 1) if len(rounds[i]) >= 2 and len(rounds[i + 1]) >= 2)
    stop = rounds[i][-2:] + rounds[i + 1][:2]  # half in one round's text, half in the next
    full = "".join(rounds)
    want = full[:full.index(stop)]
    pieces = list(generator.generate_text("def f(x):", 30, stop=stop, stream=True))
    assert "".join(pieces) == want and generator.finish_reason == "stop_string"  # its first half was held back


def test_embedded_pair_text_equals_its_engine_tokens():
    from dpara_rt.tools.compare import load_pair
    from dpara_rt.engine import Engine

    code_tokenizer, target, drafter = load_pair()
    gen = TextGenerator.build(target, drafter, code_tokenizer, method="dpara")
    text = gen.generate_text("def add(a, b):", 24)
    eng = Engine(target, drafter, eos_ids=gen.stop_ids)
    tokens = eng.generate([code_tokenizer.encode("def add(a, b):")], 24).tokens[0]
    tokens = tokens[:next((i for i, t in enumerate(tokens) if t in gen.stop_ids), len(tokens))]
    assert text == code_tokenizer.decode(tokens) and text


def test_sampled_text_is_reproducible_by_seed(generator):
    a = generator.generate_text("x", 20, temperature=1.0, seed=7)
    b = generator.generate_text("x", 20, temperature=1.0, seed=7)
    assert a == b


def test_prompt_errors(generator):
    with pytest.raises(TextError, match="no tokens"):
        generator.generate_text("", 4)
    with pytest.raises(TextError, match="chat=True"):
        generator.generate_text("hi", 4, enable_thinking=False)
    with pytest.raises(TextError, match="stop id -1"):
        generator.generate_text("hi", 4, stop_ids=[-1])
