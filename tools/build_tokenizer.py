"""Build the tiny character-level tokenizer shipped with the embedded default model.

The tokenizer lives in ``dllm_ais/assets/tiny_llada/`` and is what the tiny LLaDA-style test
and demo model uses. It is made with the ``tokenizers`` library and saved through
``PreTrainedTokenizerFast.save_pretrained``, so ``transformers.AutoTokenizer.from_pretrained``
loads it offline.

Design:
- one token per character: every printable ASCII character plus ``"\\n"`` and ``"\\t"``, so the
  embedded "digits" task text (and plain English/maths prompts) round-trips exactly;
- the LLaDA special tokens under their LLaDA names (``<|startoftext|>`` BOS, ``<|endoftext|>``
  EOS and pad, ``<|eot_id|>``, ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|mdm_mask|>``
  as the mask token) plus ``<|unk|>`` for characters outside the vocabulary;
- the Llama-3 style chat template that LLaDA-8B-Instruct uses;
- no automatic BOS/EOS when encoding: the chat template writes the BOS itself.

Running the script rewrites the files deterministically and prints the vocabulary size and the
special-token ids::

    python tools/build_tokenizer.py [--output-dir DIR]
"""
from __future__ import annotations

import argparse
import string
from pathlib import Path

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent.parent / "dllm_ais" / "assets" / "tiny_llada"

UNK_TOKEN = "<|unk|>"
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
END_OF_TURN_TOKEN = "<|eot_id|>"
MASK_TOKEN = "<|mdm_mask|>"

# Order fixes the ids: special tokens take ids 0..6, characters follow.
SPECIAL_TOKENS = [
    UNK_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    START_HEADER_TOKEN,
    END_HEADER_TOKEN,
    END_OF_TURN_TOKEN,
    MASK_TOKEN,
]
CHARACTERS = [" "] + [c for c in string.printable if c.isprintable() and c != " "] + ["\n", "\t"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

MODEL_MAX_LENGTH = 4096


def build_character_tokenizer() -> Tokenizer:
    """Return a ``tokenizers.Tokenizer`` that maps every character to its own token id."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # The regex [\s\S] matches any single character, newline included; each becomes its own piece.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return tokenizer


# A word with its leading space, an XML-style tag, or any single character (digits and newlines included).
WORD_PIECES = Regex(r" ?[A-Za-z]+|</?[a-z]+>|[\s\S]")


def build_word_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """The character tokenizer plus BPE merges learned from `texts` (``tokenizers``' BPE trainer) inside words and
    tags only: English words and the answer tags become single tokens, while every digit, operator and newline stays
    its own token, so column-by-column arithmetic reads one digit per position. Ids 0..6 are the special tokens."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(WORD_PIECES, behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=CHARACTERS,
                                  limit_alphabet=len(CHARACTERS), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return tokenizer


def build_hf_tokenizer(tokenizer: Tokenizer | None = None) -> PreTrainedTokenizerFast:
    """Wrap `tokenizer` (default: the character tokenizer) as a ``transformers`` fast tokenizer with LLaDA's special
    tokens and chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer or build_character_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        mask_token=MASK_TOKEN,
        extra_special_tokens=[START_HEADER_TOKEN, END_HEADER_TOKEN, END_OF_TURN_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
    )


def main() -> None:
    """Build the tokenizer, save it, and print its vocabulary size and special-token ids."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR,
                        help=f"where to write the tokenizer files (default: {DEFAULT_OUTPUT_DIR})")
    args = parser.parse_args()

    tokenizer = build_hf_tokenizer()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    saved_files = tokenizer.save_pretrained(args.output_dir)
    print(f"saved {', '.join(sorted(Path(f).name for f in saved_files))} to {args.output_dir}")
    print(f"vocab size: {len(tokenizer)}")
    for token in SPECIAL_TOKENS:
        print(f"  {token:<22} id {tokenizer.convert_tokens_to_ids(token)}")


if __name__ == "__main__":
    main()
