# %% [markdown]
# # A tour of astrai: load, forward, generate, chat, LoRA fine-tune, serve
#
# Everything here runs on a CPU in seconds, with no downloads: the first cells build a tiny random model (a
# Qwen3-shaped decoder and a byte-level BPE tokenizer trained on the spot) and save it as an ordinary Hugging Face
# folder. With a real checkpoint folder instead (`astrai.load("path/to/Qwen3-0.6B")`) every later cell reads the
# same; only the outputs become meaningful.
#
# This file is a percent-format notebook (`# %%` cells): open it in VS Code or in Jupyter with jupytext, or run it
# as a script (`python docs/notebooks/tour.py`). `tour.ipynb` beside it is rendered from it by
# `python docs/render.py`; the API of each function used here is in [docs/api.md](../api.md).

# %%
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
import uvicorn
from openai import OpenAI

import astrai
from astrai.data.config import config_from_dict
from astrai.data.preprocess import preprocess
from astrai.inference.engine import Engine, EngineConfig
from astrai.io.templates import chatml_template
from astrai.io.tokenizer import train_tokenizer
from astrai.nn.lora import LoRAConfig
from astrai.serve.app import build_app
from astrai.train.config import TrainConfig
from astrai.train.loop import train
from astrai.train.optim import AdamWConfig

workdir = Path(tempfile.mkdtemp(prefix="astrai-tour-"))

# %% [markdown]
# ## A tiny model to play with
#
# `train_tokenizer` trains a byte-level BPE locally (here with the bundled ChatML chat template);
# `astrai.init_params` draws random weights for a `ModelConfig`; `astrai.save` writes `config.json`,
# `model.safetensors` and the tokenizer files, a folder transformers loads too.

# %%
corpus = ["What is the capital of France? Paris.", "hello world, this is a tiny corpus", "the quick brown fox"] * 8
tokenizer = train_tokenizer(corpus, vocab_size=320, chat_template=chatml_template())
config = astrai.ModelConfig(
    model_type="qwen3",
    vocab_size=tokenizer.vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    qk_norm=True,
    max_position_embeddings=512,
    eos_token_id=(tokenizer.eos_token_id,),
)
params = astrai.init_params(config, seed=0)
random_model = astrai.Model(config=config, params=params, tokenizer=tokenizer, eos_token_ids=config.eos_token_id)
model_dir = astrai.save(random_model, workdir / "tiny-model")
print(sorted(p.name for p in Path(model_dir).iterdir()))

# %% [markdown]
# ## Load
#
# `astrai.load` reads a model folder (or a Hugging Face model id already in the local HF cache). A model is a
# plain bundle: `config` (frozen hyperparameters), `params` (a frozen tree of ordinary tensors) and `tokenizer`.

# %%
model = astrai.load(model_dir)
print(model)
print(model.tokenizer)
print("q_proj of block 0:", tuple(model.params.blocks[0].attn.q_proj.weight.shape))

# %% [markdown]
# ## Forward
#
# `astrai.forward(model, ids)` maps `[B, T]` token ids to `[B, T, V]` float32 logits (causal, no cache).

# %%
ids = torch.tensor([model.tokenizer.encode("the quick brown fox")])
logits = astrai.forward(model, ids)
next_id = int(logits[0, -1].argmax())
print(tuple(logits.shape), "next token:", repr(model.tokenizer.decode([next_id])))

# %% [markdown]
# ## Generate
#
# Greedy by default; `temperature`, `top_k`, `top_p` and `seed` for sampling. A random model writes random text.
#
# The first call on a model builds its engine and compiles the decode step (a few seconds, behind a spinner); later
# calls reuse that engine (`astrai.release_engines` frees it; it also goes with the model).

# %%
print(astrai.generate(model, ["the quick brown fox", "hello"], max_tokens=8))
print(astrai.generate(model, "hello", max_tokens=8, temperature=0.8, top_p=0.95, seed=0))

# %% [markdown]
# ## Chat
#
# `astrai.chat` renders the conversation with the model's chat template (as transformers'
# `apply_chat_template(..., add_generation_prompt=True)` does), generates, and returns the assistant's reply: a
# string for one conversation, a list of strings for a list of conversations.

# %%
question = [{"role": "user", "content": "What is the capital of France?"}]
print(model.tokenizer.apply_chat_template(question))
print("before fine-tuning:", repr(astrai.chat(model, question, max_tokens=8)))

# %% [markdown]
# ## LoRA fine-tune
#
# The library's training path in three steps: write chats as JSONL, preprocess them into packed shards (what
# `astrai preprocess` does; [docs/data.md](../data.md)), then `astrai.train.loop.train` with a `TrainConfig` whose
# `lora` field is set (what `astrai train ... --lora.r 8` does; [docs/lora.md](../lora.md)). The base weights
# stay frozen; the run folder gets the adapters (PEFT format) and a merged model.

# %%
chats = workdir / "chats.jsonl"
answer = [*question, {"role": "assistant", "content": "Paris."}]
chats.write_text("".join(json.dumps({"messages": answer}) + "\n" for _ in range(16)))
data_cfg = config_from_dict(
    {
        "kind": "sft",
        "inputs": [str(chats)],
        "tokenizer": str(model_dir),
        "output": str(workdir / "shards"),
        "sections": [{"field": "messages", "action": "$role", "template": True}],
        "preprocessing": {"max_seq_len": 64, "max_packed_len": 64},
    }
)
print(preprocess(data_cfg))

# %% [markdown]
# Sixteen steps on one repeated chat. The loss stays far above zero: the embeddings and the LM head are frozen
# random matrices of a tiny model, so the adapters can move the right token to the top but cannot make the
# softmax sharp. The greedy reply is what changes.

# %%
run = train(
    TrainConfig(
        data=workdir / "shards",
        out_dir=workdir / "lora-run",
        model=str(model_dir),
        seq_len=64,
        batch_size=4,
        steps=16,
        optim=AdamWConfig(lr=2e-2),
        lora=LoRAConfig(r=8, alpha=16, targets=("all-linear",)),
        compile=False,
        device="cpu",
    )
)
print(f"final loss {run.final_loss:.3f}; merged model in {run.model_dir}")
tuned = astrai.load(run.model_dir)
print("after fine-tuning:", repr(astrai.chat(tuned, question, max_tokens=8)))

# %% [markdown]
# ## Serve and query
#
# On the command line this is `astrai serve MODEL_DIR` ([docs/serving.md](../serving.md)). In a notebook: build
# the Starlette app around an `Engine`, run uvicorn in a background thread on a free port, and query it with the
# official `openai` SDK (`pip install openai`; `astrai[dev]` includes it).

# %%
engine = Engine(tuned, EngineConfig(compile=False, kv_budget_tokens=4096))
server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="tiny-tuned"), host="127.0.0.1", port=0))
thread = threading.Thread(target=server.run, daemon=True)
thread.start()
for _ in range(600):  # wait up to 30 s for uvicorn to bind its port
    if server.started:
        break
    time.sleep(0.05)
port = server.servers[0].sockets[0].getsockname()[1]
print(f"serving on http://127.0.0.1:{port}/v1")

# %%
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
print([m.id for m in client.models.list()])
reply = client.chat.completions.create(model="tiny-tuned", messages=question, max_tokens=8, temperature=0)
print(repr(reply.choices[0].message.content), reply.choices[0].finish_reason, reply.usage.total_tokens, "tokens")

# %% [markdown]
# Stop the server (its shutdown also shuts the engine down and frees its KV cache), then delete the files.

# %%
server.should_exit = True
thread.join(timeout=30)
print("server stopped:", not thread.is_alive())
shutil.rmtree(workdir)
