"""The in-process A/B helper's host side: variant selection and attribute swapping (the engine runs need a GPU)."""

from __future__ import annotations

import types

import pytest

from worker.bench.ab import chosen_variants, patched, variant_parser

VARIANTS = {"landed": {}, "fast": {"rule": "fast"}}


def test_patched_swaps_for_the_block_and_restores_even_on_error():
    module = types.SimpleNamespace(rule="landed", other=1)
    with patched(module, {"rule": "fast"}):
        assert (module.rule, module.other) == ("fast", 1)
    assert module.rule == "landed"
    with pytest.raises(RuntimeError), patched(module, {"rule": "fast", "other": 2}):
        raise RuntimeError("an engine run failed")
    assert (module.rule, module.other) == ("landed", 1)


def test_variants_default_to_all_then_landed_and_unknown_names_are_refused(capsys):
    parser = variant_parser("doc", VARIANTS)
    assert chosen_variants(parser, parser.parse_args([]), VARIANTS) == ["landed", "fast", "landed"]
    assert chosen_variants(parser, parser.parse_args(["fast", "--rounds", "2"]), VARIANTS) == ["fast"]
    with pytest.raises(SystemExit):
        chosen_variants(parser, parser.parse_args(["slow"]), VARIANTS)
    assert "unknown variant(s) slow" in capsys.readouterr().err
