"""Run llama.cpp's convert_hf_to_gguf.py on the benchmark checkpoint (f32).

    python gguf_convert.py LLAMA_CPP_DIR CHECKPOINT OUT.gguf

The converter names the tokenizer's pre-tokenizer by hashing how it splits a test string, and
refuses tokenizers it has never seen, as the benchmark's synthetic one is; Llama's vocab
reader also tries sentencepiece first. The benchmark feeds token ids, never text, so the
tokenizer only has to be carried over: it is read as the byte-level BPE it is ("gpt-2").
"""

import sys
from pathlib import Path

src, ckpt, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, str(src))
sys.path.insert(1, str(src / "gguf-py"))

import convert_hf_to_gguf  # noqa: E402
from conversion import base, llama  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", ckpt, "--outfile", out, "--outtype", "f32"]
convert_hf_to_gguf.main()
