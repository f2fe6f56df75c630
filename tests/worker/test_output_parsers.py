"""Output parsers on outputs written the way each family's documentation shows its format (samples written here)."""

import json

import pytest

from worker.output_parsers import OutputParsing, ParsedCall, text_with_special_tokens
from worker.output_parsers.reasoning import HarmonyReasoningParser, ThinkParser
from worker.output_parsers.tool_calls import (
    HarmonyParser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    calls_from_json_array,
)


def call(name, **arguments):
    return ParsedCall(name, json.dumps(arguments))


# --- hermes (Hermes 2 Pro, Qwen2.5, Qwen3) ----------------------------------------------------------------------


def test_hermes_parses_several_calls_and_keeps_the_text_around_them():
    text = (
        "I'll look both up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
    )
    split = HermesParser().split(text)
    assert split.calls == [call("get_weather", city="Lyon", unit="celsius"), call("get_time", tz="Europe/Paris")]
    assert split.content == "I'll look both up."


def test_hermes_leaves_a_block_that_does_not_parse_in_the_content():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ly\n</tool_call>'
    good = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'  # arguments as JSON text
    split = HermesParser().split(broken + good)
    assert split.calls == [call("f", x=1)] and split.content == broken
    cut_short = '<tool_call>\n{"name": "get_weather", "arguments": {"city"'
    assert HermesParser().split(cut_short).calls == [] and HermesParser().split(cut_short).content == cut_short


# --- Llama 3.x JSON ---------------------------------------------------------------------------------------------


def test_llama3_json_with_and_without_the_python_tag():
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert Llama3JsonParser().split(one).calls == [call("get_weather", city="Oslo")]
    two = 'Checking.<|python_tag|>{"name": "a", "parameters": {"k": 1}}; {"name": "b", "parameters": {}}'
    split = Llama3JsonParser().split(two)
    assert split.calls == [call("a", k=1), call("b")] and split.content == "Checking."


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "a", "parameters": {"k": 1}} and then some text',
        '{"answer": 42}',  # JSON, but not a call
        '{"name": "a", "parameters": {"k": 1}}; {"name": "b", "para',
    ],
)
def test_llama3_json_text_that_is_not_only_calls_stays_content(text):
    split = Llama3JsonParser().split(text)
    assert split.calls == [] and split.content == text


# --- Mistral ----------------------------------------------------------------------------------------------------


def test_mistral_json_list_form():
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "get_time", "arguments": {}}]'
    split = MistralParser().split(text)
    assert split.calls == [call("get_weather", city="Nice"), call("get_time")] and split.content is None


def test_mistral_name_args_form_with_and_without_call_ids():
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}'
    split = MistralParser().split(text)
    assert split.calls == [call("get_weather", city="Nice"), call("get_time", tz="UTC")]
    assert split.content == "Sure."


def test_mistral_without_a_parsable_call_stays_content():
    for text in ["No call here.", '[TOOL_CALLS][{"name": "f", "argu', "[TOOL_CALLS]f[ARGS]not json"]:
        assert MistralParser().split(text).calls == [] and MistralParser().split(text).content == text


# --- harmony (gpt-oss) ------------------------------------------------------------------------------------------

HARMONY_CALL = (
    "<|channel|>analysis<|message|>The user wants the weather in Rome; call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Rome"}<|call|>'
)
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Simple arithmetic: 2 + 2.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)


def test_harmony_reasoning_and_call():
    parsed = OutputParsing(HarmonyParser(), HarmonyReasoningParser()).parse(HARMONY_CALL, "model")
    assert parsed.reasoning_content == "The user wants the weather in Rome; call the tool."
    assert parsed.tool_calls == [call("get_weather", city="Rome")] and parsed.content is None


def test_harmony_final_answer_is_the_content():
    parsed = OutputParsing(HarmonyParser(), HarmonyReasoningParser()).parse(HARMONY_ANSWER, "model")
    assert (parsed.content, parsed.reasoning_content, parsed.tool_calls) == ("2 + 2 = 4.", "Simple arithmetic: 2 + 2.", [])


def test_harmony_recipient_in_the_role_part():
    text = '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}<|call|>'
    assert HarmonyParser().split(text).calls == [call("lookup", q="x")]


# --- think --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, reasoning, rest",
    [
        ("<think>\nThe user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),  # Qwen3
        ("The user greets me.\n</think>\n\nHello!", "The user greets me.", "Hello!"),  # R1: opened in the prompt
        ("<think>\nStill thinking about", "Still thinking about", ""),  # cut short while thinking
        ("Hello!", None, "Hello!"),  # thinking switched off
    ],
)
def test_think_parser(text, reasoning, rest):
    split = ThinkParser().split(text)
    assert (split.reasoning, split.rest) == (reasoning, rest)


def test_reasoning_then_hermes_calls():
    text = '<think>Need the weather.</think>\n<tool_call>\n{"name": "w", "arguments": {"c": "Oslo"}}\n</tool_call>'
    parsed = OutputParsing(HermesParser(), ThinkParser()).parse(text, "model")
    assert parsed.reasoning_content == "Need the weather." and parsed.tool_calls == [call("w", c="Oslo")]
    assert parsed.content is None
    # Without tools offered, calls are not parsed: the text after the reasoning is the content.
    parsed = OutputParsing(HermesParser(), ThinkParser()).parse(text, "none")
    assert parsed.tool_calls == [] and parsed.content.startswith("<tool_call>")


def test_nothing_found_leaves_the_output_alone():
    assert OutputParsing(HermesParser(), ThinkParser()).parse("Plain answer.", "model") is None
    assert OutputParsing().parse("<think>x</think>y", "model") is None


def test_required_calls_array():
    text = '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{}}]'
    assert calls_from_json_array(text) == [call("a", x=1), call("b")]
    assert calls_from_json_array('[{"name":"a","parameters":{"x":1}') is None
    parsed = OutputParsing(None, ThinkParser()).parse("<think>pick a</think>" + text, "array")
    assert parsed.tool_calls == [call("a", x=1), call("b")] and parsed.content is None


# --- choice and detection -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, tool_parser, reasoning_parser",
    [
        ("{{ '<tool_call>\\n' }}{{ '<think>\\n' }}", "hermes", "think"),  # Qwen3
        ("{{ '<tool_call>' }}", "hermes", None),  # Qwen2.5
        ('{{ "<|python_tag|>" }} {"name": function name, "parameters": ...}', "llama3_json", None),
        ("{{ '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral", None),
        ("{{ '<|channel|>analysis<|message|>' }}", "harmony", "harmony"),
        ("{{ 'User: ' + content }}", None, None),
        (None, None, None),
    ],
)
def test_auto_detection_from_the_chat_template(template, tool_parser, reasoning_parser):
    parsing = OutputParsing.choose("auto", "auto", template)
    assert (parsing.tool_call_parser.name if parsing.tool_call_parser else None) == tool_parser
    assert (parsing.reasoning_parser.name if parsing.reasoning_parser else None) == reasoning_parser


def test_named_and_none_override_detection():
    parsing = OutputParsing.choose("mistral", "none", "<tool_call><think>")
    assert parsing.tool_call_parser.name == "mistral" and parsing.reasoning_parser is None
    with pytest.raises(ValueError, match="--tool-call-parser: unknown parser 'xml'"):
        OutputParsing.choose("xml", "auto", None)


def test_text_with_special_tokens_keeps_markers_and_drops_the_closing_ones():
    class Tokenizer:
        names = {1: b"[TOOL_CALLS]", 2: b"</s>", 3: b"<|eot|>"}
        eos_token_ids = frozenset({2})

        def token_bytes(self, token_id):
            return self.names.get(token_id, bytes([token_id]))

        def special_token_id(self, text):
            return {v.decode(): k for k, v in self.names.items()}.get(text)

    ids = [1, *b"f[ARGS]{}", 3, 2]
    assert text_with_special_tokens(ids, Tokenizer()) == "[TOOL_CALLS]f[ARGS]{}"
    assert text_with_special_tokens(ids, Tokenizer(), drop_final_specials=False) == "[TOOL_CALLS]f[ARGS]{}<|eot|></s>"


# --- through the worker's result lines, from token ids ----------------------------------------------------------


def test_harmony_is_parsed_from_the_tokens_with_their_special_tokens(tmp_path):
    """gpt-oss's markers are special tokens: the ordinary decode drops them, so the worker parses the output
    decoded with them kept (and without its closing `<|call|>`, an end-of-sequence token)."""
    from schemas.lines import parse_request_line
    from tests.fixtures.checkpoints import Family, train_tokenizer
    from worker.admission import to_result_line
    from worker.engine.api import EngineResult, FinishReason, Usage
    from worker.engine.tokenizer import HFTokenizer

    markers = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
    family = Family("gpt_oss", ("<|endoftext|>", *markers), None, "<|return|>", "<|return|>", (), "<|return|>",
                    "{{ '<|channel|>' }}", {})  # fmt: skip
    backend = train_tokenizer(family)
    tokenizer = HFTokenizer(backend, extra_eos_ids=(backend.convert_tokens_to_ids("<|call|>"),))
    ids = tokenizer.encode(HARMONY_CALL)
    assert "<|channel|>" not in tokenizer.decode(ids)  # what the result's text holds
    body = {
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    }
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    request = parse_request_line(json.dumps(line), 1).resolve(0)
    result = EngineResult("b1:0", tokenizer.decode(ids), ids, FinishReason.STOP, Usage())
    parsing = OutputParsing.choose("auto", "auto", family.chat_template)
    record = to_result_line(request, result, tokenizer, parsing)
    assert record.reasoning_content == "The user wants the weather in Rome; call the tool."
    assert record.content is None and record.text == result.text
    [call] = record.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("call_b1-0_0_0", "get_weather", '{"city": "Rome"}')
    assert to_result_line(request, result, tokenizer).tool_calls is None  # no parsers: nothing parsed
