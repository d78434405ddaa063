"""Build the embedded default model from nothing: a byte-level BPE tokenizer trained offline on
synthetic chat text, and a small Qwen2-architecture model with seeded random weights.

    python -m server.embedded.build --out server/embedded/model

Deterministic: the same code gives the same files. The shipped model is this one warm-started
on the demo task (examples/demo/warmstart.py); the bench and tests build larger or smaller ones
with `build_model`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import typer

from server.chat.render import CHAT_TEMPLATE, render_text

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Single tokens for the tool-call markup, as in Qwen2.5 (not special: they decode into text).
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DEFAULT_DIR = Path(__file__).parent / "model"

_FILLER = (
    "the a an is are was to of and in on for with you your we our it this that what how many much "
    "please thank thanks hello hi yes no sure order item price stock cost dollars units help can "
    "I have has do does need want would like could check look up find tell me about user assistant "
    "system tool function name arguments result error unknown status cancel return modify email "
    "pending delivered cancelled total payment address size color small large red blue green black "
    "one two three four five six seven eight nine ten hundred today tomorrow sorry right wrong"
).split()


def corpus(n_conversations: int = 3000, seed: int = 0) -> list[str]:
    """Synthetic chat transcripts in the model's own format: the demo task, tool traffic in
    JSON, numbers and plain English filler, so common pieces become single tokens."""
    from examples.demo import task as demo

    rng = random.Random(seed)
    texts: list[str] = []
    example = demo.make_example(n_train=n_conversations)
    for t in example.train_tasks(seed):
        msgs = demo.demonstration(t, mistake=rng.random() < 0.5, rng=rng)
        texts.append(render_text(msgs, demo.TOOLS, add_generation_prompt=False))
    for _ in range(n_conversations):
        words = " ".join(rng.choice(_FILLER) for _ in range(rng.randint(5, 30)))
        num = str(rng.randint(0, 100000))
        texts.append(render_text([{"role": "user", "content": f"{words.capitalize()} {num}?"},
                                  {"role": "assistant", "content": f"{words} {json.dumps({'value': num})}."}],
                                 None, add_generation_prompt=True))
    return texts


def build_tokenizer(vocab_size: int = 2048, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
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


def build_model(out: Path, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 704, vocab_size: int = 2048, context: int = 2048, seed: int = 0) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, seed)
    tokenizer.save_pretrained(out)
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
    model.save_pretrained(out)
    (out / "artisan.json").write_text(json.dumps({"name": "artisan-tiny", "built_by": "server.embedded.build"}))
    return out


def main(out: Path = typer.Option(DEFAULT_DIR), hidden: int = 256, layers: int = 4, heads: int = 4,
         kv_heads: int = 2, intermediate: int = 704, seed: int = 0) -> None:
    path = build_model(out, hidden, layers, heads, kv_heads, intermediate, seed=seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    typer.run(main)
