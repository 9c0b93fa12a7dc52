"""Frontend unit-test fixtures (prefixed ``fe_``): a tiny HF-layout tokenizer
(real byte-level BPE, trained here) and the API app on an in-process fake
engine, served by uvicorn in a thread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Mixture of experts routes every token to a few experts per layer.",
    "Grüße aus Köln, naïve café, 東京タワー, emoji 🚀🔥 and ∑ math.",
    "def f(x):\n    return x * 2  # code\n",
] * 20


def make_tokenizer_files(out: Path, *, vocab_size: int = 400) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "</s>", "special": True},
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (out / "config.json").write_text(json.dumps({"model_type": "mixtral", "vocab_size": tok.get_vocab_size()}))


@pytest.fixture(scope="session")
def fe_checkpoint_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("ckpt")
    make_tokenizer_files(out)
    return str(out)


@pytest.fixture(scope="session")
def fe_tokenizer(fe_checkpoint_dir):
    from openai_frontend.tokenizer import Tokenizer

    return Tokenizer.from_dir(fe_checkpoint_dir)


# --------------------------------------------------------------------------
# The frontend app on a fake engine, served by uvicorn in a thread.

SCRIPT_TEXT = "Hello world. The quick brown fox jumps over the lazy dog. Grüße 🚀 東京 café! END."
API_KEY = "test-key"
MODEL = "tiny-moe"


class ServerThread:
    def __init__(self, app) -> None:
        import threading

        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                   lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        import time

        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.root_url = f"http://127.0.0.1:{port}"
        self.base_url = self.root_url + "/v1"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def make_model_info(**overrides):
    from openai_frontend.triton_client import ModelInfo

    meta = dict(architecture="MixtralForCausalLM", num_hidden_layers=3, moe_layers=[1, 2], num_experts=8,
                num_experts_per_tok=2, routed_experts_dtype="uint8", max_model_len=128, eos_token_ids=[1],
                vocab_size=400)
    meta.update(overrides)
    return ModelInfo.from_metadata(meta)


@pytest.fixture(scope="session")
def fe_engine(fe_tokenizer):
    from tests.unit.fake_engine import FakeEngine

    return FakeEngine(info=make_model_info(), script=fe_tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))


@pytest.fixture(scope="session")
def fe_server(fe_checkpoint_dir, fe_engine):
    from openai_frontend.app import create_app
    from openai_frontend.config import FrontendConfig

    cfg = FrontendConfig(triton_grpc_url="unused:0", served_model_name=MODEL, checkpoint_dir=fe_checkpoint_dir,
                         api_key=API_KEY, max_pending_requests=8)
    with ServerThread(create_app(cfg, engine=fe_engine)) as srv:
        srv.api_key = API_KEY
        srv.model = MODEL
        srv.engine = fe_engine
        srv.tokenizer_dir = fe_checkpoint_dir
        yield srv
