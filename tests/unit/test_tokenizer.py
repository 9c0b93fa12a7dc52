"""Tokenizer, chat template (jinja2, as transformers renders it) and incremental detokenizer."""
from __future__ import annotations

import json
import random

import pytest

from openai_frontend.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer
from tests.unit.conftest import CORPUS, make_tokenizer_files


def stream_decode(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> list[str]:
    d = tok.detokenizer(prompt, skip_special_tokens=skip)
    pieces = [d.step(t) for t in ids]
    pieces.append(d.flush())
    return pieces


def test_encode_decode_round_trip(fe_tokenizer):
    text = "Grüße aus Köln 🚀 東京"
    ids = fe_tokenizer.encode(text)
    assert ids[0] == fe_tokenizer.hf.token_to_id("<s>")  # tokenizer.json's post-processor adds BOS
    assert fe_tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert fe_tokenizer.decode(ids) == text
    assert fe_tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert fe_tokenizer.bos_token == "<s>" and fe_tokenizer.eos_token == "</s>"  # str and AddedToken dict forms


@pytest.mark.parametrize("text", CORPUS[:4] + ["🚀🔥🚀", "  leading spaces", "東京タワー\n\nnew lines\t"])
def test_detokenizer_matches_full_decode(fe_tokenizer, text):
    ids = fe_tokenizer.encode(text, add_special_tokens=False)
    prompt = fe_tokenizer.encode("Prompt: ")
    pieces = stream_decode(fe_tokenizer, prompt, ids)
    assert "".join(pieces) == fe_tokenizer.decode(ids)
    # Never a broken character in the middle of a stream.
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_random_token_sequences(fe_tokenizer):
    """Arbitrary ids (byte tokens that form invalid UTF-8 included): the pieces add up to decode()."""
    rng = random.Random(0)
    vocab = fe_tokenizer.vocab_size
    for _ in range(200):
        ids = [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 30))]
        assert "".join(stream_decode(fe_tokenizer, [], ids)) == fe_tokenizer.decode(ids)


def test_detokenizer_holds_back_partial_utf8(fe_tokenizer):
    # "🚀" is 4 bytes; with byte-level BPE it may take several tokens.
    ids = [fe_tokenizer.hf.token_to_id(t) for t in fe_tokenizer.hf.encode("🚀", add_special_tokens=False).tokens]
    d = fe_tokenizer.detokenizer([])
    pieces = [d.step(t) for t in ids]
    assert "".join(pieces) == "🚀"
    assert all(p in ("", "🚀") for p in pieces)


def test_detokenizer_skips_special_tokens(fe_tokenizer):
    eos = fe_tokenizer.hf.token_to_id("</s>")
    ids = fe_tokenizer.encode("Hello", add_special_tokens=False) + [eos]
    assert "".join(stream_decode(fe_tokenizer, [], ids)) == "Hello"
    assert "".join(stream_decode(fe_tokenizer, [], ids, skip=False)) == "Hello</s>"


def test_detokenizer_long_sequences_stay_small(fe_tokenizer):
    ids = fe_tokenizer.encode(" ".join(CORPUS), add_special_tokens=False)
    d = fe_tokenizer.detokenizer([])
    out = "".join(d.step(t) for t in ids) + d.flush()
    assert out == fe_tokenizer.decode(ids)
    assert len(d._ids) < 100


def test_token_text(fe_tokenizer):
    ids = fe_tokenizer.encode("Hello world", add_special_tokens=False)
    assert "".join(fe_tokenizer.token_text(t) for t in ids) == "Hello world"
    assert fe_tokenizer.token_text(fe_tokenizer.hf.token_to_id("</s>")) == "</s>"


def test_chat_template_renders_like_transformers(fe_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = fe_tokenizer.chat_template.render(msgs)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    assert not fe_tokenizer.chat_template.render(msgs, add_generation_prompt=False).endswith("<|assistant|>\n")
    # Special tokens in the rendered text become single ids (no BOS added twice).
    ids = fe_tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(fe_tokenizer.hf.token_to_id("<s>")) == 1
    assert fe_tokenizer.hf.token_to_id("<|assistant|>") in ids


def test_chat_template_raise_exception_is_a_template_error(fe_tokenizer):
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        fe_tokenizer.chat_template.render([{"role": "robot", "content": "x"}])


def test_chat_template_helpers_and_sandbox():
    tmpl = ChatTemplate(
        "{% for m in messages %}{{ m | tojson }}{% endfor %}{{ strftime_now('%Y') | length }}"
        "{% generation %}G{% endgeneration %}{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}"
        "{% endfor %}{{ tools | length if tools else 'none' }}",
        "<s>", "</s>",
    )
    out = tmpl.render([{"role": "user", "content": "é"}], tools=[{"a": 1}])
    assert out == json.dumps({"role": "user", "content": "é"}, ensure_ascii=False) + "4G01"
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", None, None).render([])
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}", None, None)


def test_continue_final_message(fe_tokenizer):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    text = fe_tokenizer.chat_template.render(msgs, continue_final_message=True)
    assert text.endswith("<|assistant|>\nThe answer is")


def test_extra_template_kwargs(fe_tokenizer):
    t = ChatTemplate("{{ 'think' if enable_thinking else 'plain' }}", None, None)
    assert t.render([], extra={"enable_thinking": True}) == "think"
    assert t.render([], extra={"enable_thinking": False}) == "plain"


def test_template_from_chat_template_jinja_file(tmp_path):
    make_tokenizer_files(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.chat_template.render([{"role": "user", "content": "x"}]) == "<s>x"


def test_no_template_and_missing_tokenizer(tmp_path):
    make_tokenizer_files(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(str(tmp_path)).chat_template.render([]) == "D"
    cfg.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(str(tmp_path)).chat_template is None
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(str(tmp_path / "nowhere"))
