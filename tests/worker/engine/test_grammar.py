"""grammar.py: compiling constraints, the host bitmasks, and applying them to logits on the device."""

from __future__ import annotations

import pytest
import torch

from worker.engine.api import Constraint, ConstraintKind
from worker.engine.grammar import GrammarCompiler, GrammarError, TokenMasks, apply_token_bitmask, is_allowed
from worker.engine.tokenizer import ByteTokenizer

VOCAB = 320  # the presets' padded vocabulary


@pytest.fixture(scope="module")
def compiler():
    tok = ByteTokenizer()
    return GrammarCompiler(tok, VOCAB, tok.eos_token_ids)


def test_apply_token_bitmask_matches_a_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 70, generator=gen)  # 70: not a multiple of 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=gen, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for t in range(70):
            if not is_allowed(bitmask[i], t):
                expected[row, t] = float("-inf")
    apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


def test_matchers_are_independent_copies_of_one_compiled_grammar(compiler):
    choice = Constraint(ConstraintKind.CHOICE, '["yes", "no"]')
    a, b = compiler.matcher_for(choice), compiler.matcher_for(choice)
    assert list(compiler._cache) == [choice]
    assert a.consume_tokens(list(b"yes")) and a.is_stopped()
    assert not b.is_stopped() and b.consume_tokens(list(b"no")) and b.is_stopped()


def test_masks_cover_the_model_vocabulary_and_allow_eos_only_when_complete(compiler):
    masks = TokenMasks(VOCAB, max_num_seqs=4, pin=False)
    m = compiler.matcher_for(Constraint(ConstraintKind.REGEX, "[0-9]{1,2}"))
    rows = masks.fill(0, [m, None])
    allowed = [t for t in range(VOCAB) if is_allowed(rows[0], t)]
    assert allowed == list(b"0123456789")  # no EOS before the first digit; padding ids never
    assert all(is_allowed(rows[1], t) for t in range(VOCAB)), "a finished request's row allows everything"
    assert m.consume_token(ord("7"))
    rows = masks.fill(1, [m])
    assert [t for t in range(VOCAB) if is_allowed(rows[0], t)] == [
        *b"0123456789",
        ByteTokenizer().eos_token_id,
    ]


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint(ConstraintKind.REGEX, "(unclosed"),
        Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2"),
        Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "nope"}'),
        Constraint(ConstraintKind.CHOICE, '["a", 3]'),
        Constraint(ConstraintKind.CHOICE, "not json"),
    ],
)
def test_invalid_constraints_raise_grammar_error(compiler, constraint):
    with pytest.raises(GrammarError, match="constraint"):
        compiler.matcher_for(constraint)
