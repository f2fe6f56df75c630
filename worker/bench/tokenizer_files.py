"""Tokenizers for random-weight checkpoints, trained offline: a byte-level BPE over a small English corpus with a
family's special tokens appended (as the releases place them, after the trained vocabulary) and its chat template.

Shared by the benchmarks that build a checkpoint's files (vision.py) and the tests' fixtures
(tests/fixtures/checkpoints.py re-exports `Family`, `corpus` and `train_tokenizer`), so that both tokenize alike.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water "
    "than call first who may down side been now find answer question json name value yes true false"
).split()


@dataclass(frozen=True)
class Family:
    model_type: str
    specials: tuple[str, ...]  # appended after the trained vocabulary, in this order
    bos: str | None  # added by the tokenizer's post-processor
    tokenizer_eos: str
    config_eos: str  # the one eos config.json names
    generation_eos: tuple[str, ...]  # generation_config.json's list
    end_of_turn: str
    chat_template: str
    sampling: dict  # generation_config.json's sampling fields
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    config: dict = field(default_factory=dict)  # the family's own config.json knobs, as its releases set them


def corpus(num_lines: int = 1500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + "." for _ in range(num_lines)]


def train_tokenizer(family: Family, vocab_size: int = 480):
    """A byte-level BPE trained on a small corpus, special tokens appended, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.add_special_tokens(list(family.specials))
    if family.bos is not None:
        bos_id = tok.token_to_id(family.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A $B", special_tokens=[(family.bos, bos_id)]
        )
    pad = next((t for t in ("<|endoftext|>", "<pad>") if t in family.specials), None)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.tokenizer_eos,
        pad_token=pad,
        chat_template=family.chat_template,
    )
