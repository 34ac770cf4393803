"""Train llmx's demo model: a small Llama on the running CPython's standard library, on CPU.

    python scripts/train_demo_model.py --out llmx/demo_model --minutes 45 --threads 2

Everything is local (no downloads) and seeded: with the same interpreter, library versions,
--threads and --steps the run is repeatable. --minutes sets the step count from the measured
pace (lowering it if the shared machine slows down); MODEL_CARD.md records what happened.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

# The machine is shared: busy-waiting OpenMP threads slow down 3x when another job takes a core.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from demo_data import EXCLUDED_DIRS, HELD_OUT_PERCENT, stdlib_files  # noqa: E402  (this script's folder is on sys.path)

# ChatML-like turns spelled in plain text (the 4096-token vocabulary has no special tokens for them),
# with Hermes-style <tool_call> JSON and the Jinja `tools` variable, as Qwen's templates have.
CHAT_TEMPLATE = '{%- if tools %}\n<|im_start|>system\n{% if messages[0].role in (\'system\', \'developer\') %}{{ messages[0].content }}\n\n{% endif %}You may call one or more functions. The functions, as JSON schemas:\n<tools>\n{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson }}\n{% endfor %}</tools>\nTo call one, answer with <tool_call>{"name": "...", "arguments": {...}}</tool_call>.<|im_end|>\n{% elif messages[0].role in (\'system\', \'developer\') %}\n<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}\n{%- for message in messages %}\n{%- if loop.first and message.role in (\'system\', \'developer\') %}\n{%- elif message.role == \'tool\' %}\n<|im_start|>tool\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n{% else %}\n<|im_start|>{{ message.role }}\n{% if message.content %}{{ message.content }}{% endif %}\n{%- for call in message.tool_calls or [] %}\n{%- set fn = call.function if call.function is defined else call %}\n<tool_call>{"name": {{ fn.name | tojson }}, "arguments": {{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}</tool_call>\n{%- endfor %}<|im_end|>\n{% endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}\n'

EOT, PAD = "<|endoftext|>", "<|pad|>"  # ids 0 and 1; EOT is BOS and EOS, as in GPT-2
MODEL = dict(hidden_size=256, intermediate_size=576, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def read_texts(root: Path, rels: list[str]) -> list[str]:
    return [(root / rel).read_text(encoding="utf-8", errors="replace") for rel in rels]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # No prefix space: code starts at column 0. GPT-2's regex keeps runs of indentation together.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    # Every training file starts after an EOT, so prompts get one too (it marks "start of file").
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B",
                                                       special_tokens=[(EOT, 0)])
    return tok


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """EOT file1 EOT file2 ... EOT fileN EOT: the files in order, each preceded by an EOT."""
    ids = [i for enc in tok.encode_batch(texts) for i in enc.ids] + [0]
    return torch.tensor(ids, dtype=torch.long)


def random_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
    return torch.stack([data[s : s + seq] for s in starts])


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, seq: int, max_windows: int | None = None, batch: int = 16) -> tuple[float, int]:
    """Mean next-token NLL over non-overlapping windows of `seq` tokens (stride `seq`, the last
    partial window dropped); each window is scored on its own and predicts its last seq-1 tokens."""
    model.eval()
    n = len(data) // seq if max_windows is None else min(len(data) // seq, max_windows)
    windows = data[: n * seq].view(n, seq)
    total = 0.0
    for i in range(0, n, batch):
        x = windows[i : i + batch]
        logits = model(input_ids=x).logits.float()
        total += torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
    model.train()
    return total / (n * (seq - 1)), n


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10 %


def sample(model, tok, prompt: str, new_tokens: int, temperature: float, seed: int) -> str:
    ids = torch.tensor([tok.encode(prompt).ids])
    torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
    out = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=0, pad_token_id=1, **kw)
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("llmx/demo_model"))
    ap.add_argument("--minutes", type=float, default=45.0, help="training time budget (ignored with --steps)")
    ap.add_argument("--steps", type=int, default=None, help="exact number of optimizer steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=512, help="training window = max_position_embeddings")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args()
    import transformers as T

    t0 = time.time()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    root, train_rels, held_rels = stdlib_files()
    train_texts, held_texts = read_texts(root, train_rels), read_texts(root, held_rels)
    tok = train_tokenizer(train_texts, args.vocab)  # the held-out files are not seen by the tokenizer either
    train_data, held_data = token_stream(tok, train_texts), token_stream(tok, held_texts)
    print(f"stdlib {root}: {len(train_rels)} training files ({len(train_data):,} tokens), "
          f"{len(held_rels)} held out ({len(held_data):,} tokens); tokenizer {time.time() - t0:.0f}s")

    config = T.LlamaConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=args.seq, bos_token_id=0,
                           eos_token_id=0, pad_token_id=1, **MODEL)
    model = T.LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    # Weight decay on matrices only (not norms), the usual nanoGPT split.
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=False)
    gen = torch.Generator().manual_seed(args.seed)
    steps, calibrate, warmup = args.steps or 10**9, 50, 100
    t_train, log, plans = time.time(), [], []
    t_mark = t_train
    bar = tqdm(total=args.steps, desc="train", dynamic_ncols=True, mininterval=2)
    step = 0
    while step < steps:
        if args.steps is None and step == calibrate:
            # Fix the step count from the pace so far, with a 15 % margin for others' jobs.
            pace = (time.time() - t_train) / calibrate
            steps = max(calibrate + 1, int(args.minutes * 60 / pace * 0.85))
            bar.total = steps
            plans.append((step, steps))
            print(f"\n{pace:.3f}s/step -> {steps} steps for {args.minutes:g} minutes")
        elif args.steps is None and step > calibrate and step % args.eval_every == 0:
            # If others' jobs slowed us down, end sooner (the cosine compresses) rather than run late.
            pace = (time.time() - t_mark) / args.eval_every
            fits = step + int((t_train + args.minutes * 60 - time.time()) / pace)
            if fits < steps:
                steps = bar.total = max(step + 1, fits)
                plans.append((step, steps))
        t_mark = time.time() if step % args.eval_every == 0 else t_mark
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, warmup)  # warmup > calibrate: unaffected by the unknown total
        x = random_batch(train_data, args.batch, args.seq, gen)
        # bf16 autocast doubles CPU throughput; master weights and optimizer state stay fp32.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % args.eval_every == 0 or step == steps:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                held, _ = held_out_loss(model, held_data, args.seq, max_windows=32)
            log.append((step, round(loss.item(), 4), round(held, 4)))
            tqdm.write(f"step {step}: train loss {loss.item():.3f}, held-out loss (32 windows, bf16) {held:.3f}")
    bar.close()
    train_minutes = (time.time() - t_train) / 60

    # Ship fp16, and measure what ships: fp16 weights, upcast, evaluated in fp32.
    model = model.half().float().eval()
    nll, windows = held_out_loss(model, held_data, args.seq)
    prompt = "def fibonacci(n):"
    samples = {"greedy": sample(model, tok, prompt, 64, 0.0, args.seed),
               **{f"temperature 0.8, seed {s}": sample(model, tok, prompt, 96, 0.8, s) for s in (1, 2)}}
    for name, text in samples.items():
        print(f"--- {name} ---\n{text}")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = T.GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model.half().save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT, "pad_token": PAD,
        "add_bos_token": True, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    stats = dict(params=n_params, steps=steps, tokens_seen=steps * args.batch * args.seq, train_minutes=train_minutes,
                 total_minutes=(time.time() - t0) / 60, held_nll=nll, windows=windows, log=log, size=(out / "model.safetensors").stat().st_size,
                 train_files=len(train_rels), train_tokens=len(train_data), held_tokens=len(held_data), plans=plans)
    (out / "MODEL_CARD.md").write_text(model_card(args, config, stats, held_rels, samples))
    print(f"held-out perplexity {math.exp(nll):.3f} over {windows} windows; wrote {out} "
          f"({stats['size'] / 1e6:.1f} MB) in {stats['total_minutes']:.1f} min")


def model_card(args, config, s: dict, held_rels: list[str], samples: dict[str, str]) -> str:
    import tokenizers
    import transformers

    py = platform.python_version()
    command = f"python scripts/train_demo_model.py --out {args.out} --steps {s['steps']} --seed {args.seed} --threads {args.threads}"
    if len(s["plans"]) > 1:  # the total changed mid-run, so --steps alone cannot replay the LR schedule
        how = ", then ".join(f"{total} at step {at}" for at, total in s["plans"])
        repro = (f"`--minutes {args.minutes:g}` set the step count from the measured pace ({how}, lowered as the shared\n"
                 f"machine slowed). `{command}` runs as many steps on the same data, with the LR schedule\n"
                 f"planned for {s['steps']} steps from the start, so its weights will differ slightly.")
    elif s["plans"]:
        repro = f"`--minutes {args.minutes:g}` set the step count from the measured pace; `{command}` reproduces the run."
    else:
        repro = f"`{command}` reproduces the run."
    fence = "```"
    rows = "\n".join(f"| {st} | {tr} | {he} |" for st, tr, he in s["log"])
    shown = "\n\n".join(f"{name}:\n\n{fence}python\n{text}\n{fence}" for name, text in samples.items())
    return f"""# llmx demo model: a {s['params'] / 1e6:.1f}M-parameter Llama trained on CPython {py}'s standard library

A tiny code model shipped inside llmx so that `llmx export` / `generate` run end to end with no
download. It writes Python-looking code; it is not useful for anything else.

## Architecture
`LlamaForCausalLM`: {config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} query heads / {config.num_key_value_heads} KV heads (GQA, head dim {config.hidden_size // config.num_attention_heads}),
SwiGLU MLP {config.intermediate_size}, RMSNorm (eps {config.rms_norm_eps}), RoPE (theta {MODEL["rope_theta"]:g}), tied embeddings,
vocab {config.vocab_size}, context {config.max_position_embeddings} tokens. {s['params']:,} parameters, stored in float16
(`model.safetensors`, {s['size'] / 1e6:.2f} MB).

## Data
The `.py` files of CPython {py}'s standard library (`sysconfig.get_paths()["stdlib"]` of the training
interpreter), licensed under the PSF License Agreement (Python Software Foundation License Version 2).
Excluded: files under any directory named {', '.join(f'`{d}`' for d in sorted(EXCLUDED_DIRS))},
`config-*/`, and `_sysconfigdata*.py`.
Held out for evaluation: a file whose posix path relative to the stdlib root, `rel`, has
`int(sha256(rel.encode()).hexdigest(), 16) % 100 < {HELD_OUT_PERCENT}` ({len(held_rels)} files, {s['held_tokens']:,} tokens):
{', '.join(f'`{r}`' for r in held_rels)}.
Training: the other {s['train_files']} files, {s['train_tokens']:,} tokens.

## Tokenizer
Byte-level BPE (`tokenizers` {tokenizers.__version__}, GPT-2 pre-tokenization, no prefix space), {config.vocab_size} tokens, trained
on the training files only. Special tokens: `{EOT}` (id 0) is BOS and EOS, `{PAD}` (id 1) pads.
Files are joined as `{EOT} file1 {EOT} file2 ... {EOT} fileN {EOT}`, so the tokenizer's post-processor
prepends `{EOT}` to every encoded text (`add_special_tokens=True`), as at the start of a file in training.

## Training
{repro}
{s['steps']} AdamW steps (betas 0.9/0.95, weight decay 0.1 on matrices,
grad clip 1.0), peak LR {args.lr:g}, 100 warmup steps then cosine to 10 %, batch {args.batch} random windows of {args.seq}
tokens of the training stream ({s['tokens_seen']:,} tokens seen, {s['tokens_seen'] / s['train_tokens']:.1f} epochs), bf16 autocast with fp32 weights.
Seed {args.seed}, {args.threads} CPU threads, torch {torch.__version__}, transformers {transformers.__version__}.
Training took {s['train_minutes']:.1f} minutes, the whole script {s['total_minutes']:.1f} minutes, on a shared 2-core CPU.

| step | train loss | held-out loss (first 32 windows, bf16) |
| --- | --- | --- |
{rows}

## Evaluation
Held-out perplexity **{math.exp(s['held_nll']):.3f}** (mean NLL {s['held_nll']:.4f} nats/token) of the shipped float16 weights upcast to float32.
Protocol: the held-out files above, in sorted path order, tokenized and joined as `{EOT} file1 {EOT} ... {EOT} fileN {EOT}`;
cut into non-overlapping windows of {args.seq} tokens (stride {args.seq}, first token at offset 0, the final partial window dropped:
{s['windows']} windows); each window is scored independently (no BOS added, no carried context) and predicts
its last {args.seq - 1} tokens; perplexity = exp(total NLL / ({s['windows']} x {args.seq - 1})).

## Samples
Prompt `def fibonacci(n):` (encoded with a leading `{EOT}`), float32:

{shown}
"""


if __name__ == "__main__":
    main()
