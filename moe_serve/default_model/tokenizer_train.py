"""Train a small byte-level BPE tokenizer with `tokenizers` and write it in Hugging Face's layout.

Used by the tiny built-in model and by the tests' checkpoints: a real tokenizer (merges, special
tokens, a ChatML chat template) without any download.
"""
from __future__ import annotations

import json
import os

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A few paragraphs of plain English (with digits, punctuation and some accented and CJK text so that
# multi-byte characters have their own merges) are enough to give a few hundred useful merges.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few experts.
Serving engines batch requests together, page the key and value cache into fixed-size blocks, and
schedule tokens rather than requests. Paris is the capital of France. Berlin is the capital of Germany.
Madrid is the capital of Spain. Rome is the capital of Italy. Tokyo is the capital of Japan.
One, two, three, four, five, six, seven, eight, nine, ten. 0123456789 3.14159 2.71828 1,000,000.
What is the capital of France? The answer is Paris. How many legs does a spider have? Eight.
Hello, world! Hello there. How are you today? I am fine, thank you. Let me think step by step.
The weather is nice and the sun is shining. Water boils at one hundred degrees Celsius.
Café, naïve, résumé, jalapeño, über, smörgåsbord. 東京は日本の首都です。 北京是中国的首都。 Привет, мир!
def main(): return [x * 2 for x in range(10)]  # code, too: {"key": "value", "list": [1, 2, 3]}
"""


def train_tokenizer(out_dir: str, vocab_size: int = 512, corpus: str | None = None) -> None:
    """Write tokenizer.json and tokenizer_config.json (ChatML template, eos <|im_end|>) to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus if corpus is not None else _CORPUS
    tok.train_from_iterator([line for line in text.splitlines() if line.strip()] * 4, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def special_token_ids(out_dir: str) -> dict[str, int]:
    """Ids of the special tokens in a tokenizer written by train_tokenizer."""
    with open(os.path.join(out_dir, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    return {t: vocab[t] for t in SPECIAL_TOKENS}
