"""Build the embedded base model from nothing: a byte-level BPE tokenizer trained offline on
synthetic chat text, a small Qwen2-architecture model with seeded random weights, and a short
full-parameter pretraining on synthetic tool-use conversations (examples/demo/corpus.py).

    python -m examples.demo.pretrain --out DIR [--pretrain-steps N]

Deterministic: the same code gives the same files. The shipped model is this base warm-started
on the demo task by examples/demo/warmstart.py. Tests and benchmarks build their own models
with `build_model(..., pretrain_steps=0)` in seconds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import typer

from examples.demo.corpus import conversation
from server.embedded.template import CHAT_TEMPLATE, render_text

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Single tokens for the tool-call markup, as in Qwen2.5 (not special: they decode into text).
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_FILLER = (
    "the a an is are was to of and in on for with you your we our it this that what how many much "
    "please thank thanks hello hi yes no sure order item price stock cost dollars units help can "
    "I have has do does need want would like could check look up find tell me about user assistant "
    "system tool function name arguments result error unknown status cancel return modify email "
    "pending delivered cancelled total payment address size color small large red blue green black "
    "one two three four five six seven eight nine ten hundred today tomorrow sorry right wrong"
).split()


def corpus(n_conversations: int = 3000, seed: int = 0) -> list[str]:
    """Synthetic chat transcripts in the model's own format: tool traffic in JSON, numbers and
    plain English filler, so common pieces become single tokens."""
    rng = random.Random(seed)
    texts: list[str] = []
    for _ in range(n_conversations):
        msgs, tools = conversation(rng)
        texts.append(render_text(msgs, tools, add_generation_prompt=False))
    for _ in range(n_conversations):
        words = " ".join(rng.choice(_FILLER) for _ in range(rng.randint(5, 30)))
        num = str(rng.randint(0, 100000))
        texts.append(render_text([{"role": "user", "content": f"{words.capitalize()} {num}?"},
                                  {"role": "assistant", "content": f"{words} {json.dumps({'value': num})}."}],
                                 None, add_generation_prompt=True))
    return texts


# Qwen2's pre-tokenizer: digits one by one, so a number is copied digit by digit. transformers
# applies this split when it loads a qwen2 tokenizer whatever the file says, so training the BPE
# with anything else gives a model that never saw numbers the way they are served.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(vocab_size: int = 2048, seed: int = 0):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + MARKUP_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def pretrain(model, tokenizer, steps: int, batch_size: int = 16, lr: float = 2e-3, seed: int = 0) -> None:
    """Full-parameter language modelling on synthetic tool-use chats (cosine schedule)."""
    import math
    import time

    import torch

    from server.chat.format import ChatFormat

    renderer = ChatFormat.build(tokenizer).renderer
    rng = random.Random(seed + 1)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    model.train()
    started, recent = time.time(), []
    for step in range(steps):
        progress = (step - warmup) / max(1, steps - warmup)
        scale = (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        seqs = [renderer.render(*conversation(rng), add_generation_prompt=False).ids for _ in range(batch_size)]
        width = max(len(s) for s in seqs)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, : len(s)] = torch.tensor(s)
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == steps:
            print(f"pretrain step {step + 1}/{steps}: loss {sum(recent) / len(recent):.3f} "
                  f"({time.time() - started:.0f}s)", flush=True)
            recent = []
    model.eval()


def build_model(out: Path, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 704, vocab_size: int = 2048, context: int = 2048, seed: int = 0,
                pretrain_steps: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    built = build_tokenizer(vocab_size, seed)
    built.save_pretrained(out)
    # Train with the tokenizer exactly as the server will load it, and prove they agree.
    tokenizer = AutoTokenizer.from_pretrained(out)
    for text in corpus(50, seed + 7):
        if tokenizer.encode(text, add_special_tokens=False) != built.encode(text, add_special_tokens=False):
            raise RuntimeError("the saved tokenizer does not tokenize like the one that was trained")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    if pretrain_steps:
        pretrain(model, tokenizer, pretrain_steps, seed=seed)
    model.save_pretrained(out)
    (out / "artisan.json").write_text(json.dumps({"name": "artisan-tiny", "built_by": "examples.demo.pretrain"}))
    return out


def main(out: Path = typer.Option(...), hidden: int = 256, layers: int = 4, heads: int = 4,
         kv_heads: int = 2, intermediate: int = 704, seed: int = 0, pretrain_steps: int = 0) -> None:
    path = build_model(out, hidden, layers, heads, kv_heads, intermediate, seed=seed, pretrain_steps=pretrain_steps)
    print(f"wrote {path}")


if __name__ == "__main__":
    typer.run(main)
