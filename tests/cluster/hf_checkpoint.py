"""A checkpoint in the Hugging Face layout, built at test time without downloads: the trained
tiny model's weights and config.json, a byte-level BPE `tokenizer.json` trained here with the
`tokenizers` library (vocabulary within the model's 512 ids), a `tokenizer_config.json` with a
ChatML `chat_template`, and a `generation_config.json` with a list of EOS ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TRAINED = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny-trained"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (the model's pad, bos, eos)
CHATML = ("{{ bos_token }}{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] if message['content'] is defined else '')"
          " + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nimport sys\nfrom pathlib import Path\n\nclass Reader:\n    def read(self, path):\n",
    "The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café ✓ 😀 emoji!\n",
    "You are a helpful assistant. Answer the user's question about Python code briefly.\n",
] * 8


def make_hf_checkpoint(out: Path, vocab_size: int = 400) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(TRAINED / "config.json", out / "config.json")
    (out / "model.safetensors").symlink_to(TRAINED / "model.safetensors")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= 512 and [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML, "model_max_length": 4096}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 0}))
    return out
