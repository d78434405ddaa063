"""What `--model` may name and what the server reads off the model itself: a hub id that cannot be
downloaded is one clear line, and context window, stop ids, dtype and LoRA targets come from each
architecture's own config. Gradient checkpointing trains exactly as without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from client import SFTConfig, TrainableModel
from client.local_server import ROOT
from server.model.host import ModelHost, pick_dtype
from server.model.source import hub_patterns, served_name
from tests.families import FAMILIES, tiny_architecture_dir, tiny_model_dir

LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the hub is out of reach, as on this machine and many GPU nodes
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.unit
@pytest.mark.parametrize("files, weights", [
    (["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      "consolidated.safetensors", "original/consolidated.00.pth", "pytorch_model.bin"],
     ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]),
    (["config.json", "pytorch_model.bin", "tokenizer.json"], ["pytorch_model.bin"]),  # no safetensors published
    ([], ["*.safetensors"]),  # no listing: offline, what the cache has
])
def test_one_copy_of_the_weights_is_downloaded(files, weights):
    patterns = hub_patterns(files)
    assert [p for p in patterns if p.endswith((".safetensors", ".bin"))] == weights
    assert {"*.json", "*.jinja", "*.model"} <= set(patterns)


def test_a_hub_id_that_cannot_be_downloaded_is_one_clear_line(tmp_path):
    proc = _serve("--model", "Qwen/Qwen2.5-0.5B-Instruct", "--data-dir", str(tmp_path))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "could not download it from the Hugging Face hub" in last and "local directory" in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("model", ["no/such/thing/at/all", "./not-a-dir"])
def test_a_model_that_is_neither_file_nor_directory_nor_hub_id_is_refused(tmp_path, model):
    proc = _serve("--model", model, "--data-dir", str(tmp_path))
    assert proc.returncode != 0 and "--model" in proc.stderr.strip().splitlines()[-1]


def test_a_model_whose_tokenizer_has_no_chat_template_is_one_clear_line(tmp_path):
    model = tiny_architecture_dir("LlamaConfig", tmp_path, num_key_value_heads=2)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for f in model.glob("chat_template*"):
        f.unlink()
    proc = _serve("--model", str(model), "--data-dir", str(tmp_path / "data"), "--device", "cpu")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "no chat template" in last and "--chat-template FILE" in last and "base_model.jinja" in last, last


def test_a_model_whose_weights_are_damaged_is_one_clear_line(tmp_path):
    model = tiny_architecture_dir("LlamaConfig", tmp_path, num_key_value_heads=2)
    with open(model / "model.safetensors", "r+b") as weights:
        weights.truncate(1000)
    proc = _serve("--model", str(model), "--data-dir", str(tmp_path / "data"), "--device", "cpu")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {model.name} could not be loaded: ") and len(last) < 400, last


def test_a_model_that_is_not_a_causal_lm_is_one_clear_line(tmp_path):
    import transformers

    from tests.families import tokenizer_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir("smollm2", tmp_path))
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=len(tokenizer), d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, decoder_start_token_id=0))
    t5.save_pretrained(tmp_path / "t5")
    tokenizer.save_pretrained(tmp_path / "t5")
    proc = _serve("--model", str(tmp_path / "t5"), "--data-dir", str(tmp_path / "data"), "--device", "cpu")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "t5 model" in last and "decoder-only" in last and len(last) < 300, last


@pytest.mark.unit
def test_a_model_is_served_under_the_name_it_was_given(tmp_path):
    """A GGUF's cache directory is named by a content hash and a hub snapshot by a commit: neither
    is a name a user would guess, so the served name is the file's stem or the hub id."""
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert served_name(gguf) == served_name(str(gguf)) == "SmolLM2-135M-Instruct.Q4_1"
    assert served_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert served_name(tmp_path) is None  # a directory's own name (or its artisan.json) serves


@pytest.mark.unit
@pytest.mark.parametrize("family", ["qwen2_5", "qwen3", "llama3_1", "mistral_v0_3", "gemma3"])
def test_the_model_config_decides_window_stops_and_lora_targets(family, tmp_path_factory):
    model_dir = tiny_model_dir(family, tmp_path_factory.mktemp(family))
    host = ModelHost(model_dir, device="cpu")
    assert host.context_window == host.config.max_position_embeddings == 2048
    eos = host.tokenizer.convert_tokens_to_ids(FAMILIES[family].eos)
    assert eos in host.chat.stop_ids
    assert host.lora_targets == LINEAR
    assert host.dtype == torch.float32


@pytest.mark.unit
def test_bfloat16_on_cuda_float32_on_cpu_unless_asked():
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("float16", torch.device("cpu")) == torch.float16


async def test_gradient_checkpointing_trains_the_same_step(server, fresh_server):
    """The same SFT step from the same seeded LoRA: same loss, same update, with less memory."""
    checkpointed = fresh_server(extra=["--gradient-checkpointing"])
    conversations = [[{"role": "user", "content": f"What is {i} plus {i}?"},
                      {"role": "assistant", "content": f"It is {2 * i}."}] for i in range(6)]

    async def step(url: str):
        model = await TrainableModel("gc-check").register(url)
        return (await model.train_sft(conversations, SFTConfig(learning_rate=1e-3, batch_size=3))).metrics

    plain, gc = await step(server.url), await step(checkpointed.url)
    assert gc.trained and gc.optimizer_steps == plain.optimizer_steps == 2
    assert gc.loss == pytest.approx(plain.loss, rel=1e-4)
    assert gc.lora_update_norm == pytest.approx(plain.lora_update_norm, rel=1e-3)
