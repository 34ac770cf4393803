"""GGUF pre-tokenizers (``tokenizer.ggml.pre``): llmx's rebuild of llama.cpp's splits.

Each family's reference is the ``pre_tokenizer`` of its own Hugging Face tokenizer.json, copied
here: llama.cpp's regexes for that name must split text as it does. Every name llama.cpp knows
builds and runs; an unknown one is refused; a GGUF naming "smollm" rebuilds a whole tokenizer.
"""

from __future__ import annotations

import json

import pytest

from llmx.errors import CheckpointError
from llmx.export.gguf_pretokenizers import IGNORE_MERGES, NAMES, NOT_BYTE_LEVEL, TYPES, oniguruma, pre_tokenizer

LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
TEKKEN_REGEX = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
                "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
                "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex: bool, trim_offsets: bool = True) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": trim_offsets, "use_regex": use_regex}


_DIGITS_THEN_GPT2 = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                          _byte_level(True)]}
# llama.cpp name -> "pre_tokenizer" of the family's tokenizer.json on the Hugging Face hub (the repository in the
# comment). With their vocabularies, all but tekken's reproduce the ids in llama.cpp's models/ggml-vocab-*.gguf.out
# (written from the Hugging Face tokenizers by convert_hf_to_gguf_update.py).
REFERENCES = {
    "gpt-2": _byte_level(True),  # openai-community/gpt2
    # meta-llama/Meta-Llama-3-8B
    "llama-bpe": {"type": "Sequence", "pretokenizers": [_split(LLAMA3_REGEX), _byte_level(False)]},
    # Qwen/Qwen2-7B
    "qwen2": {"type": "Sequence", "pretokenizers": [_split(QWEN2_REGEX), _byte_level(False, trim_offsets=False)]},
    "smollm": _DIGITS_THEN_GPT2,  # HuggingFaceTB/SmolLM2-135M
    "starcoder": _DIGITS_THEN_GPT2,  # bigcode/starcoder
    # deepseek-ai/deepseek-coder-6.7b-base
    "deepseek-coder": {"type": "Sequence", "pretokenizers": [
        _split("[\r\n]"), _split("\\s?\\p{L}+"), _split("\\s?\\p{P}+"), _split("[一-龥ࠀ-一가-퟿]+"),
        {"type": "Digits", "individual_digits": True}, _byte_level(False)]},
    # mistralai/Mistral-Nemo-Base-2407 (its regex is also the one llama.cpp quotes as tekken's original)
    "tekken": {"type": "Sequence", "pretokenizers": [_split(TEKKEN_REGEX), _byte_level(False)]},
}
DEVANAGARI = "नमस्ते दुनिया, यह एक परीक्षण है।"
TEXTS = [
    "12345 and 3.14159",
    "x=1234567890123; y = 0xDEADBEEF; z=1e-10 1,000,000.00$",
    "def f(x):\n    x+=1;\n\tif(y) { return x }\n",
    "    indented\n\n\n  two   three    four     spaces  \n \n",
    "   leading spaces\ttabs\r\nCRLF\r\n\r\nend   ",
    "I'M don't you're WE'LL they've she'd it's",
    "中文分词测试：你好，世界！",
    "日本語のテキスト、カタカナとひらがな。한국어 텍스트",
    "مرحبا بالعالم ١٢٣٤٥",
    DEVANAGARI,
    "emoji 🙂🚀👨\u200d👩\u200d👧 ok ✅",
    "Mixed: Ünïcödé façade, naïve café — “quotes” and ‘single’… 中文English混合123字符",
    "HelloWorld CamelCase ÀÉÎõü ÀbcDéf McDONALD'S iPhone",
    "!!!!!! ??? ... --- +++ <=> ^^^ ~~~ ||| ``` $$$",
    "url: https://example.com/a/b?c=d&e=f#g path/to/file.py:12:3",
]
# llama.cpp rewrites Tekken's regex without \p{M}: combining marks do not join their letters (llmx follows
# llama.cpp, as llama-server's /tokenize shows).
DIVERGES = {"tekken": {DEVANAGARI}}


def _reference(pre: dict):
    from tokenizers import Tokenizer

    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": {}, "merges": []}
    return Tokenizer.from_str(json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                                          "normalizer": None, "pre_tokenizer": pre, "post_processor": None,
                                          "decoder": None, "model": model})).pre_tokenizer


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_pre_tokenizer_splits_as_the_familys_tokenizer_json(name):
    pytest.importorskip("tokenizers")
    reference, ours = _reference(REFERENCES[name]), pre_tokenizer(name)
    for text in TEXTS:
        if text not in DIVERGES.get(name, ()):
            assert ours.pre_tokenize_str(text) == reference.pre_tokenize_str(text), text
    for text in DIVERGES.get(name, ()):
        assert ours.pre_tokenize_str(text) != reference.pre_tokenize_str(text), text


def test_every_name_llama_cpp_knows_builds_and_splits():
    pytest.importorskip("tokenizers")
    sample = " ".join(TEXTS)
    for name, kind in NAMES.items():
        if kind in NOT_BYTE_LEVEL:
            with pytest.raises(CheckpointError, match="not byte-level"):
                pre_tokenizer(name)
            continue
        pieces = pre_tokenizer(name).pre_tokenize_str(sample)
        assert len(pieces) > 20, name
        assert pieces[-1][1][1] == len(sample), name  # every character in some piece
    assert len(NAMES) == 91 and IGNORE_MERGES <= NAMES.keys()


def test_llama_cpp_splitting_quirks_are_kept():
    """Where llama.cpp's regexes do not run as written (custom splitters, std::regex's Unicode
    shortcuts), the rebuilt split is llama.cpp's, as checked against llama-server."""
    pytest.importorskip("tokenizers")

    def pieces(name, text):
        return [text[a:b] for _, (a, b) in pre_tokenizer(name).pre_tokenize_str(text)]

    # digits in groups of three from the right, the text before them joined to the first group
    assert pieces("afmoe", "a  1234567") == ["a", " ", " ", "1", "234", "567"]
    assert pieces("tiny_aya", "x1234y") == ["x", "1", "234", "y"]
    assert pieces("superbpe", "1234567 ١٢٣٤") == ["1", "234", "567", " ", "١٢٣٤"]  # ASCII digits only
    # \p{Lu} etc. are any letter in llama.cpp; kimi-k2's words join cases too
    assert pieces("youtu", "HelloWorld iPhone") == ["HelloWorld", " iPhone"]
    assert pieces("kimi-k2", "HelloWorld中文x") == ["HelloWorld", "中文", "x"]
    # non-ASCII whitespace is never in deepseek's literal ranges
    assert pieces("deepseek-llm", "\u3000x。\u3000。") == ["\u3000x", "。", "\u3000", "。"]
    assert oniguruma("\\p{Lu}[\\p{Ll}]") == "\\p{L}[\\p{L}]"


def test_no_name_is_llama_cpps_default_and_an_unknown_name_is_refused():
    pytest.importorskip("tokenizers")
    assert pre_tokenizer(None).pre_tokenize_str("a+=b") == pre_tokenizer("default").pre_tokenize_str("a+=b")
    assert len(TYPES["DEFAULT"]) == 4
    with pytest.raises(CheckpointError) as err:
        pre_tokenizer("no-such-tokenizer")
    assert str(err.value).count("\n") == 0
    assert "'no-such-tokenizer' is not supported" in str(err.value) and "unknown to llama.cpp" in str(err.value)
    assert "llama-cpp-python 0.3.36" in str(err.value)


def _fields(values: dict):
    return lambda key, default=None: values.get(key, default)


def test_ignore_merges_takes_a_piece_in_the_vocabulary_whole(tmp_path):
    """llama.cpp's ignore_merges (llama3, tekken, ...): "abc" is a token but no merge reaches it."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from llmx.export.gguf_tokenizer import package_gguf_tokenizer

    ids = {}
    for pre in ("llama-bpe", "qwen2"):
        package_gguf_tokenizer(_fields({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                        "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "abc"],
                                        "tokenizer.ggml.merges": ["a b"]}), tmp_path / pre)
        ids[pre] = Tokenizer.from_file(str(tmp_path / pre / "tokenizer" / "tokenizer.json")).encode("abc").ids
    assert ids == {"llama-bpe": [4], "qwen2": [3, 2]}


def test_gguf_naming_smollm_rebuilds_its_tokenizer(tmp_path):
    """A byte-level GGUF with tokenizer.ggml.pre = "smollm" tokenizes as the same vocabulary with
    SmolLM's own pre-tokenizer (digits one by one, then GPT-2's split)."""
    gguf = pytest.importorskip("gguf")
    from checkpoints import train_tokenizer
    from tokenizers import Tokenizer

    from llmx.export.gguf import GGUFSource
    from llmx.export.gguf_tokenizer import package_gguf_tokenizer

    train_tokenizer(tmp_path / "hf", vocab_size=1000)
    hf = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    vocab = hf["model"]["vocab"] | {a["content"]: a["id"] for a in hf["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    specials = {a["content"] for a in hf["added_tokens"] if a["special"]}
    writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in hf["model"]["merges"]])
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = tmp_path / "tok.gguf"
    package_gguf_tokenizer(GGUFSource(path, gguf.GGUFReader(str(path))).field, tmp_path)
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer" / "tokenizer.json"))
    reference = Tokenizer.from_str(json.dumps(hf | {"pre_tokenizer": REFERENCES["smollm"]}))
    gpt2 = Tokenizer.from_str(json.dumps(hf))
    for text in TEXTS + ["</s>end", "def f(x):\n    return x[0] + 1000"]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text, text
    # the vocabulary has merges across digits, so a wrong pre-tokenizer would show
    assert gpt2.encode("x = 1000").ids != reference.encode("x = 1000").ids
