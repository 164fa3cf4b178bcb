"""A Hugging Face-format checkpoint (BPE tokenizer.json, ChatML chat_template, generation_config):
prompts equal transformers' apply_chat_template token for token, streaming text never splits a
character, stop strings match across tokens, and generation_config's EOS list is read."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.text.chat import ChatTemplateError, load_chat_template
from cluster.text.detokenizer import IncrementalDecoder, TextStream
from cluster.text.text_model import load_text_model
from cluster.text.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer
from tests.cluster.hf_checkpoint import CHATML, make_hf_checkpoint

CONVERSATIONS = [
    [{"role": "user", "content": "def fibonacci(n):"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Héllo ✓ 😀"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "import os"},
     {"role": "assistant", "content": "import sys\n"}, {"role": "user", "content": "class Reader:"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}, {"role": "user", "content": "y"}],
    [{"role": "user", "content": "<|im_end|> inside text"}],
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-hf")


@pytest.fixture(scope="module")
def reference(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompt_equals_transformers_token_for_token(hf_dir, reference, messages, add_generation_prompt):
    text = load_text_model(hf_dir)
    ours = text.tokenizer.encode(text.chat_template.render(messages, add_generation_prompt), add_special_tokens=False)
    theirs = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    assert ours == theirs
    assert ours[0] == 0  # the template's {{ bos_token }}, from tokenizer_config.json
    header = text.tokenizer.encode("<|im_start|>assistant\n")
    assert (ours[-len(header):] == header) == add_generation_prompt


@settings(max_examples=40, derandomize=True, deadline=None)
@given(st.text(max_size=40))
def test_encode_decode_match_transformers(reference, hf_dir, s):
    tok = load_tokenizer(hf_dir)
    assert tok.encode(s) == reference(s)["input_ids"]
    assert tok.decode(tok.encode(s)) == reference.decode(reference(s)["input_ids"], skip_special_tokens=True) == s


def test_generation_config_and_specials(hf_dir):
    text = load_text_model(hf_dir)
    assert isinstance(text.tokenizer, HFTokenizer) and text.tokenizer.eos_token_id == 2
    assert text.generation.eos_token_ids == (2, 0) and text.stop_token_ids == (2, 0)
    assert text.tokenizer.decode([1, 67, 2]) == text.tokenizer.decode([67])  # specials skipped
    assert text.tokenizer.decode([1], skip_special_tokens=False) == "<|im_start|>"


def test_generation_config_flag_auto_vllm_or_folder(tmp_path, hf_dir):
    """vLLM's --generation-config: auto = the checkpoint's file (EOS ids and request defaults), vllm = its
    EOS ids only (requests fall back to OpenAI's defaults), a folder = that folder's file; a folder
    without one is an error naming it, never a silent fallback."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(hf_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 40}))
    auto = load_text_model(model).generation
    assert (auto.eos_token_ids, auto.sampling, auto.max_new_tokens) == ((2, 0), {"temperature": 0.6, "top_p": 0.95}, 40)
    plain = load_text_model(model, generation_config="vllm").generation
    assert (plain.eos_token_ids, plain.sampling, plain.max_new_tokens) == ((2, 0), {}, None)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": 5, "top_k": 20}))
    folder = load_text_model(model, generation_config=str(other)).generation
    assert (folder.eos_token_ids, folder.sampling, folder.max_new_tokens) == ((5,), {"top_k": 20}, None)
    with pytest.raises(TokenizerError, match=r"--generation-config .*nowhere.* does not exist"):
        load_text_model(model, generation_config=str(tmp_path / "nowhere"))
    with pytest.raises(TokenizerError, match="has no generation_config.json"):
        load_text_model(model, generation_config=str(tmp_path))


def test_bad_files_are_clear_errors(tmp_path, hf_dir):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        load_chat_template(hf_dir, "{% for %}")
    with pytest.raises(ChatTemplateError, match="no such file"):
        load_chat_template(hf_dir, "missing.jinja")
    template = load_chat_template(hf_dir, "{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        template.render([{"role": "user", "content": "x"}])
    assert load_chat_template(hf_dir).source == CHATML
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "a"}]) == "a!"


@settings(max_examples=30, derandomize=True, deadline=None)
@given(st.text(alphabet="aé✓😀 \nxdef", max_size=30), st.integers(1, 4))
def test_streamed_text_equals_decode_without_split_characters(hf_dir, s, step):
    tok = load_tokenizer(hf_dir)
    ids = tok.encode(s)
    dec = IncrementalDecoder(tok)
    pieces = [dec.feed(ids[i:i + step], final=i + step >= len(ids)) for i in range(0, len(ids), step)]
    assert "".join(pieces) == tok.decode(ids) == s
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("tok_kind", ["bpe", "byte"])
def test_stop_string_spanning_tokens(hf_dir, tok_kind):
    tok = load_tokenizer(hf_dir) if tok_kind == "bpe" else ByteTokenizer()
    text = "def fibonacci(n):\n    return n END here"
    ids = tok.encode(text)
    stream = TextStream(tok, stop=["END", "never"])
    shown, used_total = "", 0
    for i in ids:
        piece, used = stream.feed([i])
        shown += piece
        used_total += used
        assert "E" not in shown  # held back until it is known not to start "END"
        if stream.stopped:
            break
    assert stream.stopped and stream.matched_stop == "END" and shown == "def fibonacci(n):\n    return n "
    assert tok.decode(ids[:used_total]).endswith("END") or tok_kind == "bpe"  # BPE may merge "END" with " "
    assert stream.feed([ids[-1]]) == ("", 0)  # nothing after the stop
    keep = TextStream(tok, stop=["END"], include_stop=True)
    assert keep.feed(ids, final=True)[0] == "def fibonacci(n):\n    return n END"


def test_stop_string_not_matched_flushes_everything(hf_dir):
    tok = load_tokenizer(hf_dir)
    stream = TextStream(tok, stop=["zzz"])
    ids = tok.encode("lazy dog zz")
    out = "".join(stream.feed([i])[0] for i in ids)
    assert out == "lazy dog " and not stream.stopped  # "zz" held back: it may start "zzz"
    assert out + stream.feed([], final=True)[0] == "lazy dog zz"


TRICKY = ("{% if tools is not none %}TOOLS{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}"
          "{% generation %}[{{ m.get('thinking', '') }}|{{ m.content | default('') }}]{% endgeneration %}"
          "{% else %}{{ m.role }}:{{ m.content | tojson }}\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}>{% endif %}")


def test_template_features_render_as_transformers(hf_dir, reference):
    """`tools is not none`, `{% generation %}`, reasoning aliases, tojson of non-ASCII, null content."""
    messages = [{"role": "user", "content": "héllo \"x\""},
                {"role": "assistant", "content": "a", "reasoning_content": "why"},
                {"role": "assistant", "content": None}, {"role": "user", "content": "b"}]
    template = load_chat_template(hf_dir, TRICKY, load_tokenizer(hf_dir).special_tokens)
    theirs = reference.apply_chat_template(messages, chat_template=TRICKY, add_generation_prompt=True,
                                           tokenize=False)
    assert template.render(messages) == theirs and "TOOLS" not in theirs and "[why|a]" in theirs


def _llama_style_tokenizer(out: Path) -> Path:
    """SentencePiece-style BPE as Llama ships it: "▁" for spaces, byte fallback, a decoder that
    strips the first leading space (so a token decodes differently alone than in context)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    from tests.cluster.hf_checkpoint import CORPUS

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    return load_tokenizer(_llama_style_tokenizer(tmp_path_factory.mktemp("llama")))


@settings(max_examples=30, derandomize=True, deadline=None)
@given(st.text(alphabet="ab é✓😀\nfox日ß", min_size=1, max_size=24))
def test_llama_style_streaming_equals_decode(llama_tokenizer, s):
    tok = llama_tokenizer
    assert sum(tok._tok.id_to_token(i).startswith("<0x") for i in tok.encode("日")) == 3  # byte fallback in play
    ids = tok.encode(s)
    dec = IncrementalDecoder(tok)
    pieces = [dec.feed([i], final=n == len(ids) - 1) for n, i in enumerate(ids)]
    assert "".join(pieces) == tok.decode(ids) and all("\ufffd" not in p for p in pieces)
