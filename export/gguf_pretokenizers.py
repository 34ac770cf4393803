"""llama.cpp's byte-level BPE pre-tokenizers (GGUF ``tokenizer.ggml.pre``) as ``tokenizers`` ones.

A GGUF names its pre-tokenizer; the split regexes live in llama.cpp, so they are copied here from
``src/llama-vocab.cpp`` of the llama.cpp vendored in llama-cpp-python 0.3.36: each name's
LLAMA_VOCAB_PRE_TYPE_* (``llama_vocab::impl::load``), each type's ``regex_exprs`` (the
``llm_tokenizer_bpe`` constructor). The strings below are the C++ literals verbatim (C++ and
Python escapes agree). A type's regexes run in sequence, each splitting the previous one's
pieces, with unmatched stretches kept as pieces (``Split(behavior="isolated")``); the pieces are
then byte-level encoded.

``tokenizer.ggml.model`` values llama.cpp reads that llmx refuses (only "gpt2", byte-level BPE,
and "llama", SentencePiece BPE, are rebuilt): "bert" (WordPiece), "t5" (Unigram), "rwkv",
"plamo2", "gemma4", "hybriddna", "whitespace", "no_vocab"/"none", "test".
"""

from __future__ import annotations

import re

from llmx.errors import CheckpointError

LLAMA_CPP = "llama.cpp as vendored in llama-cpp-python 0.3.36"

_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
           "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
          "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_DEEPSEEK3 = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
              "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
_GPT4O = ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+"
          "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
          "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*"
          "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
          "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_CASED = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
          "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
          "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
          "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?")
_BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"
_CJK = "[一-龥぀-ゟ゠-ヿ]+"

# LLAMA_VOCAB_PRE_TYPE_* -> regex_exprs
TYPES: dict[str, tuple[str, ...]] = {
    "DEFAULT": ("[\\p{P}\\$\\+<=>\\^~\\|]+", _GPT2, "\\p{N}+", "[0-9][0-9][0-9]"),
    "GPT2": (_GPT2,),
    "STARCODER": ("\\p{N}", _GPT2),
    "LLAMA3": (_LLAMA3,),
    "JAIS2": ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
              "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)"
              "|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",),
    "DEEPSEEK_LLM": (  # \u escapes: characters that Unicode normalisation of this file would change
        "[\r\n]",
        "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ"
        "-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻ"
        "Ȿ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}+",
    ),
    "DEEPSEEK_CODER": ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+", "\\p{N}"),
    "DEEPSEEK3_LLM": ("\\p{N}{1,3}", _CJK, _DEEPSEEK3),
    "SPARK2_5": ("\\p{N}{1,3}", _CJK,
                 "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                 "| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+", "\\p{N}"),
    "YOUTU": ("[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
              _CASED + "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
    "FALCON": ("[\\p{P}\\$\\+<=>\\^~\\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "QWEN2": (_QWEN2,),
    "QWEN35": ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
               "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "BLOOM": (_BLOOM,),
    "VIKING": (_BLOOM, "\\p{N}"),
    "TEKKEN": ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+"
               "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*"
               "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "CHAMELEON": ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
                  "[\\p{P}!-/:-@\\[-`{-~]", _GPT2),
    "GPT4O": (_GPT4O,),
    "GRANITE_EMB_MULTI": (_GPT4O.replace("(?=[\\p{L}])", "(?=[\\p{L}\\p{M}])"),),
    "TINY_AYA": ("\\d{1,3}(?=(?:\\d{3})*\\b)",
                 _CASED + "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
    "KIMI_K2": ("\\p{Han}+",),
    "SUPERBPE": ("\\p{N}+", "(?=(\\d{3})+(?!\\d))"),
    "BAILINGMOE": ("'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
    "SEED_CODER": ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}"
                   "| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "UFAKZEKA": ("[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "AFMOE": ("\\p{AFMoE_digits}", "[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
              "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
              "| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
    "LAGUNA": ("[^\\n]+|[\\n]+", _QWEN2),
    "EXAONE_MOE": ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                   "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?"
                   "|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",),
    "MINICPM5": ("\\p{N}{1,3}",
                 "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
                 "|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
}
# Types whose pieces llama.cpp does not byte-encode: BPE over raw UTF-8 (gemma4's and sarvam-moe's with spaces as
# U+2581 and <0xNN> byte fallback), a tokenizer unlike the byte-level one llmx rebuilds for "gpt2".
NOT_BYTE_LEVEL = {"GEMMA4": ("[^\\n]+|[\\n]+",), "SARVAM_MOE": ("[^\\n]+|[\\n]+",), "WHITESPACE": ("\\S+",)}

# LLAMA_VOCAB_PRE_TYPE_* -> the tokenizer.ggml.pre names llama.cpp maps to it, types with the same regex_exprs
# under one (DBRX, SMAUG, CHATGLM4 under LLAMA3, MPT, OLMO, ... under GPT2)
_NAMES = {
    "DEFAULT": ("default",),
    "GPT2": ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
             "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
             "granite-docling"),
    "STARCODER": ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
    "LLAMA3": ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
               "dbrx", "smaug-bpe", "chatglm-bpe", "glm4", "glm5"),
    "JAIS2": ("jais-2",),
    "DEEPSEEK_LLM": ("deepseek-llm",),
    "DEEPSEEK_CODER": ("deepseek-coder",),
    "DEEPSEEK3_LLM": ("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"),
    "SPARK2_5": ("spark2_5",),
    "YOUTU": ("youtu",),
    "FALCON": ("falcon",),
    "QWEN2": ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
              "grok-2"),
    "QWEN35": ("qwen35",),
    "BLOOM": ("bloom", "poro-chat", "gpt3-finnish"),
    "VIKING": ("viking",),
    "TEKKEN": ("tekken",),
    "CHAMELEON": ("chameleon",),
    "GPT4O": ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    "GRANITE_EMB_MULTI": ("granite-embed-multi-97m",),
    "TINY_AYA": ("tiny_aya", "cohere2moe"),
    "KIMI_K2": ("kimi-k2",),
    "SUPERBPE": ("superbpe",),
    "BAILINGMOE": ("bailingmoe", "bailingmoe2", "llada-moe"),
    "SEED_CODER": ("seed-coder",),
    "UFAKZEKA": ("ufakzeka",),
    "AFMOE": ("afmoe",),
    "LAGUNA": ("laguna",),
    "EXAONE_MOE": ("exaone-moe",),
    "MINICPM5": ("minicpm5",),
    "GEMMA4": ("gemma4", "granite-embed-multi-311m"),
    "SARVAM_MOE": ("sarvam-moe",),
    "WHITESPACE": ("whitespace",),
}
NAMES: dict[str, str] = {name: kind for kind, names in _NAMES.items() for name in names}
# Names for which llama.cpp sets ignore_merges: a piece that is itself in the vocabulary is taken whole.
IGNORE_MERGES = frozenset({"minicpm5", "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                           "lfm2", "jina-v5-nano", "youtu", "glm4", "glm5", "tekken", "granite-embed-multi-97m"})

# llama.cpp does not run these through a regex engine as written; each replacement splits as llama.cpp does.
_HAN = ("\\x{3400}-\\x{4DBF}\\x{4E00}-\\x{9FFF}\\x{F900}-\\x{FAFF}\\x{20000}-\\x{2A6DF}\\x{2A700}-\\x{2EBEF}"
        "\\x{2F800}-\\x{2FA1F}")
_NOT_WIDE_SPACE = "&&[^\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}]"
_DIGIT_GROUPS = "(?>\\P{N}*)(?:\\p{N}{1,2}(?=(?:\\p{N}{3})*(?!\\p{N}))|\\p{N}{3})|\\P{N}+"
_SPECIAL = {
    # unicode_regex_split_custom_kimi_k2 (the name is only its trigger): unicode_cpt_is_han's ranges, not \p{Han};
    # a word is any run of letters, upper and lower case alike, marks not included, unlike Kimi's own regex.
    "\\p{Han}+": f"[{_HAN}]+|[^\\r\\n\\p{{L}}\\p{{N}}]?[\\p{{L}}&&[^{_HAN}]]+"
                 "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
                 "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    # unicode_regex_split_custom_afmoe: a run of digits in groups of 3 from the right, the text before the
    # run joined to its first group (which changes what later regexes see, e.g. "a  12" keeps "a  1" together).
    "\\p{AFMoE_digits}": _DIGIT_GROUPS,
    "\\d{1,3}(?=(?:\\d{3})*\\b)": _DIGIT_GROUPS,
    # Regexes with no \p{..} run through std::wregex on text where non-ASCII whitespace is \v: no literal range
    # matches it (U+3000 is in the first one's U+3000-U+3002, U+2000-U+200A and U+3000 in the second's U+0800-U+4E00).
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+": "\\s?[!-/:-~！-／：-～‘-‟　-。" + _NOT_WIDE_SPACE + "]+",
    "[一-龥ࠀ-一가-퟿]+": "[一-龥ࠀ-一가-퟿" + _NOT_WIDE_SPACE + "]+",
    # std::regex's $ is only the end of the piece; Oniguruma's is also before a \n (none is left here by then).
    "\\s+$": "\\s+\\z",
    # std::wregex's \d is ASCII only; Oniguruma's is any decimal digit.
    "(?=(\\d{3})+(?!\\d))": "(?=([0-9]{3})+(?![0-9]))",
}
# Regexes with \p{..} and no custom splitter run on text where each non-ASCII character is replaced by one
# byte per category (unicode_regex_split): \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm}, \p{Lo} all become "any letter".
_LETTER_CASE = re.compile(r"\\p\{L[ultmo]\}")


def oniguruma(regex: str) -> str:
    """A llama.cpp split regex as the ``tokenizers`` Regex (Oniguruma) that splits the same way."""
    return _LETTER_CASE.sub(r"\\p{L}", _SPECIAL.get(regex, regex))


def pre_tokenizer(name: str | None):
    """The ``tokenizers`` pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre`` = ``name``."""
    from tokenizers import Regex, pre_tokenizers

    kind = NAMES.get(name) if name else "DEFAULT"  # as llama.cpp, which warns that quality will suffer
    if kind is None:
        raise CheckpointError(f"GGUF pre-tokenizer {name!r} is not supported: it is unknown to {LLAMA_CPP} too "
                              f"({len(NAMES)} names known)")
    if kind in NOT_BYTE_LEVEL:
        raise CheckpointError(f"GGUF pre-tokenizer {name!r} is not supported: llama.cpp does not byte-encode its "
                              "pieces (BPE over raw UTF-8), it is not byte-level BPE")
    if kind == "GPT2":
        # GPT-2's own regex: llama.cpp's plus "|\s+", whose pieces an isolated split keeps anyway
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    splits = [pre_tokenizers.Split(Regex(oniguruma(r)), behavior="isolated") for r in TYPES[kind]]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
