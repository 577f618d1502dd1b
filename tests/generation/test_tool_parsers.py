"""Tool-call formats (``gymbridge.generation.tool_calls``): golden texts, ``tool_call_unparsed``, round
trips, ``auto`` per tiny family, the XML form through the model server and the native loop to an
environment, and agreement with genuine nemo-gym's and vLLM's parsers (in their own venvs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from gen_helpers import XML_TOOLS_CHAT_TEMPLATE, call_tokens, xml_tools_generator
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gymbridge.generation.chat import ChatCodec, chat_to_messages, responses_to_messages
from gymbridge.generation.hf import HFGenerator
from gymbridge.generation.outputs import response_items
from gymbridge.generation.scripted import ScriptedGenerator
from gymbridge.generation.server import ModelServer, ModelServerConfig
from gymbridge.generation.tool_calls import (
    TOOL_CALL_UNPARSED,
    TOOL_PARSERS,
    ToolCall,
    detect_tool_parser,
    resolve_tool_parser,
    tool_call_format,
)
from gymbridge.generation.types import Generation

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(__file__).resolve().parent / "_tool_parser_peers.py"
for extra in (ROOT / "tests" / "gym", ROOT / "tests" / "vllm"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

HERMES = tool_call_format("hermes")
XML = tool_call_format("qwen3_coder")
ZOOM_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "zoom",
            "description": "Zoom into a region.",
            "parameters": {
                "type": "object",
                "properties": {
                    "bbox": {"type": "array", "items": {"type": "number"}},
                    "label": {"type": "string"},
                    "scale": {"type": "number"},
                    "steps": {"type": "integer"},
                    "sharpen": {"type": "boolean"},
                    "options": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
    {"type": "function", "name": "answer", "parameters": {"properties": {"text": {"type": "string"}}}},
]
"""``zoom`` (Chat Completions shape) and ``answer`` (a flat Responses function spec)."""
ANSWER_TOOL = {
    "type": "function",
    "function": {"name": "answer", "parameters": {"properties": {"text": {"type": "string"}}}},
}


def calls_of(text: str, fmt: Any, tools: Any = None) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in fmt.parse(text, tools).calls]


def xml_block(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# ---------------------------------------------------------------- golden texts -> calls

XML_ZOOM = xml_block(
    "zoom",
    ("bbox", "[10, 20, 110, 220]"),
    ("label", "a red\ncar, left of the tree"),
    ("scale", "2.5"),
    ("steps", "3"),
    ("sharpen", "true"),
    ("options", '{"mode": "fast", "keep": [1, 2]}'),
    ("note", "null"),
)
XML_GOLDEN: list[tuple[str, str, Any, list[tuple[str, Any]], str]] = [
    (
        "several typed parameters, a multi-line value",
        XML_ZOOM,
        ZOOM_TOOLS,
        [
            (
                "zoom",
                {
                    "bbox": [10, 20, 110, 220],
                    "label": "a red\ncar, left of the tree",
                    "scale": 2.5,
                    "steps": 3,
                    "sharpen": True,
                    "options": {"mode": "fast", "keep": [1, 2]},
                    "note": None,
                },
            )
        ],
        "",
    ),
    (
        "text before the call",
        "I will zoom in on the car.\n\n" + xml_block("zoom", ("bbox", "[0, 0, 5, 5]")),
        ZOOM_TOOLS,
        [("zoom", {"bbox": [0, 0, 5, 5]})],
        "I will zoom in on the car.",
    ),
    (
        "several calls in one generation",
        xml_block("zoom", ("steps", "1")) + "\n" + xml_block("answer", ("text", "42")),
        ZOOM_TOOLS,
        [("zoom", {"steps": 1}), ("answer", {"text": "42"})],
        "",
    ),
    (
        "a string parameter that spells a number stays text with a schema",
        xml_block("zoom", ("label", "42"), ("note", "007")),
        ZOOM_TOOLS,
        [("zoom", {"label": "42", "note": "007"})],
        "",
    ),
    (
        "untyped values (no schema) are the JSON value their text spells, else the text",
        xml_block("crop", ("box", "[1, 2, 3, 4]"), ("n", "42"), ("flag", "false"), ("name", "left half")),
        None,
        [("crop", {"box": [1, 2, 3, 4], "n": 42, "flag": False, "name": "left half"})],
        "",
    ),
    (
        "only one newline each side is markup",
        xml_block("answer", ("text", "\n  indented\n")),
        ZOOM_TOOLS,
        [("answer", {"text": "\n  indented\n"})],
        "",
    ),
    (
        "a call without parameters",
        "<tool_call>\n<function=snapshot>\n</function>\n</tool_call>",
        None,
        [("snapshot", {})],
        "",
    ),
    (
        "Jinja's True / None for a typed boolean and null; a failed conversion reads untyped",
        xml_block("zoom", ("sharpen", "True"), ("note", "None"), ("steps", "3.5")),
        ZOOM_TOOLS,
        [("zoom", {"sharpen": True, "note": None, "steps": 3.5})],
        "",
    ),
]
HERMES_GOLDEN: list[tuple[str, str, list[tuple[str, Any]], str]] = [
    (
        "text before one call",
        'Let me look.\n<tool_call>\n{"name": "zoom", "arguments": {"bbox": [1, 2, 3, 4]}}\n</tool_call>',
        [("zoom", {"bbox": [1, 2, 3, 4]})],
        "Let me look.",
    ),
    (
        "several calls",
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": "é\\n"}}\n</tool_call>',
        [("a", {}), ("b", {"x": "é\n"})],
        "",
    ),
    (
        "'parameters' reads as 'arguments'",
        '<tool_call>{"name": "a", "parameters": {"k": [true, null]}}</tool_call>',
        [("a", {"k": [True, None]})],
        "",
    ),
]


@pytest.mark.parametrize(
    ("why", "text", "tools", "calls", "content"), XML_GOLDEN, ids=[g[0] for g in XML_GOLDEN]
)
def test_qwen3_coder_golden(why: str, text: str, tools: Any, calls: list[Any], content: str) -> None:
    parsed = XML.parse(text, tools)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert parsed.content == content and parsed.unparsed == []
    assert all(c.call_id.startswith("call_") for c in parsed.calls)


@pytest.mark.parametrize(
    ("why", "text", "calls", "content"), HERMES_GOLDEN, ids=[g[0] for g in HERMES_GOLDEN]
)
def test_hermes_golden(why: str, text: str, calls: list[Any], content: str) -> None:
    parsed = HERMES.parse(text, ZOOM_TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert parsed.content == content and parsed.unparsed == []


def test_reasoning_before_an_xml_call_is_split_off(tiny: Any) -> None:
    codec = ChatCodec(tiny.processor, chat_template=XML_TOOLS_CHAT_TEMPLATE)
    for text in (
        "<think>\nthe car is small\n</think>\n\n" + XML_ZOOM,
        "the car is small\n</think>\n\n" + XML_ZOOM,  # the template opened <think> (Qwen3 style)
    ):
        parsed = codec.parse_text(text, ZOOM_TOOLS)
        assert [r.strip() for r in parsed.reasoning] == ["the car is small"]
        assert parsed.content == "" and [c.name for c in parsed.tool_calls] == ["zoom"]
        assert json.loads(parsed.tool_calls[0].arguments)["steps"] == 3


# ---------------------------------------------------------------- tool_call_unparsed

XML_MALFORMED: list[tuple[str, str]] = [
    (
        "<tool_call>\n<function=zoom>\n<parameter=steps>\n3\n</parameter>\n</tool_call>",
        "never closed by </function>",
    ),
    (
        "<tool_call>\n<function=zoom>\n<parameter=steps>\n3\n</function>\n</tool_call>",
        "<parameter=steps> is never",
    ),
    (xml_block("zoom", ("steps", "1"), ("steps", "2")), "'steps' is given twice"),
    ("<tool_call>\n<function=zoom>\nsteps: 3\n</function>\n</tool_call>", "text outside <parameter="),
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", "no function name"),
    ("<tool_call>\n<function=a>\n</function>\n<function=b>\n</function>\n</tool_call>", "more than one"),
    ('<tool_call>\n{"name": "zoom", "arguments": {}}\n</tool_call>', "the hermes form"),
    ("<function=zoom>\n<parameter=steps>\n3\n</parameter>\n</function>", "outside a <tool_call> block"),
    ("I am done.</tool_call>", "</tool_call> without its <tool_call>"),
    ("<tool_call>\n<function=zoom>\n<parameter=steps>\n3", "never closed by </tool_call>"),
    ("<tool_call>\n<function=zoom>\n<tool_call>\n<function=answer>\n</tool_call>", "before the next"),
    ("<tool_call>\n<function=zoom\n<parameter=steps>\n3\n</parameter>\n</function>\n</tool_call>", "'>'"),
]
HERMES_MALFORMED: list[tuple[str, str]] = [
    ('<tool_call>{"name": "zoom", "arguments": {</tool_call>', "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
    ("<tool_call>[1, 2]</tool_call>", "not an object"),
    ("<tool_call>\n<function=zoom>\n</function>\n</tool_call>", "the qwen3_coder form"),
    ('<tool_call>{"name": "zoom"', "never closed"),
]


@pytest.mark.parametrize(
    ("fmt", "text", "reason"),
    [(XML, t, r) for t, r in XML_MALFORMED] + [(HERMES, t, r) for t, r in HERMES_MALFORMED],
    ids=[f"qwen3_coder-{i}" for i in range(len(XML_MALFORMED))]
    + [f"hermes-{i}" for i in range(len(HERMES_MALFORMED))],
)
def test_malformed_markup_is_tool_call_unparsed_and_stays_in_the_text(
    fmt: Any, text: str, reason: str
) -> None:
    parsed = fmt.parse(text, ZOOM_TOOLS)
    assert parsed.calls == [] and parsed.content == text  # nothing dropped: a plain message
    assert parsed.unparsed, "the markup must be reported"
    assert {u.kind for u in parsed.unparsed} == {TOOL_CALL_UNPARSED}
    assert any(reason in u.reason for u in parsed.unparsed), [u.reason for u in parsed.unparsed]
    assert all(u.format == fmt.name and u.markup in text for u in parsed.unparsed)
    record = parsed.unparsed[0].as_json()
    assert record["kind"] == "tool_call_unparsed" and record["format"] == fmt.name


def test_a_good_and_a_bad_call_in_one_generation() -> None:
    bad = "<tool_call>\n<function=zoom>\n<parameter=steps>\n3\n</tool_call>"
    good = xml_block("answer", ("text", "hi"))
    parsed = XML.parse(f"{bad}\n{good}", ZOOM_TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("answer", {"text": "hi"})]
    assert parsed.content == bad and [u.markup for u in parsed.unparsed] == [bad]


def test_plain_text_is_no_tool_call() -> None:
    for fmt in (XML, HERMES):
        parsed = fmt.parse("The answer is 42 <b>bold</b>.")
        assert (parsed.calls, parsed.unparsed, parsed.content) == ([], [], "The answer is 42 <b>bold</b>.")


# ---------------------------------------------------------------- round trips (properties)

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
STRINGS = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), max_size=24)
SCALARS = st.one_of(
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.booleans(),
    st.none(),
    STRINGS,
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=3),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(NAMES, JSON_VALUES, max_size=5)


def schema_of(value: Any) -> dict[str, str]:
    kinds = [(bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array")]
    if value is None:
        return {"type": "null"}
    return {"type": next((k for t, k in kinds if isinstance(value, t)), "object")}


def tools_for(name: str, arguments: dict[str, Any]) -> list[dict[str, Any]]:
    props = {k: schema_of(v) for k, v in arguments.items()}
    return [
        {
            "type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": props}},
        }
    ]


@settings(max_examples=200)
@given(name=NAMES, arguments=ARGUMENTS, fmt=st.sampled_from([XML, HERMES]))
def test_render_then_parse_round_trips(name: str, arguments: dict[str, Any], fmt: Any) -> None:
    """Property: a call written in a format parses back to itself (with the tool's schema), and
    rendering the parsed call writes the same text."""
    text = fmt.render(name, arguments)
    parsed = fmt.parse(text, tools_for(name, arguments))
    assert parsed.unparsed == [] and parsed.content == ""
    (call,) = parsed.calls
    assert (call.name, json.loads(call.arguments)) == (name, arguments)
    assert fmt.render_calls(parsed.calls) == text


def _untyped_safe(value: Any) -> bool:
    """A string value stays a string without a schema unless its text spells another JSON value."""
    if isinstance(value, str):
        try:
            return isinstance(json.loads(value), str) or not value.strip()
        except ValueError:
            return True
    return True


@settings(max_examples=100)
@given(name=NAMES, arguments=ARGUMENTS)
def test_untyped_xml_text_round_trips(name: str, arguments: dict[str, Any]) -> None:
    """Property: without a schema, parsing and rendering again reproduces the text (strings that
    spell a JSON value are read as that value: the documented exception)."""
    text = XML.render(name, arguments)
    (call,) = XML.parse(text).calls
    if all(_untyped_safe(v) for v in arguments.values()):
        assert XML.render_calls([call]) == text


@settings(max_examples=40)
@given(
    calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3),
    content=st.sampled_from(["", "On it."]),
)
def test_the_chat_template_text_parses_back_to_its_calls(
    tiny: Any, calls: list[tuple[str, dict[str, Any]]], content: str
) -> None:
    """Property: the assistant turn the XML chat template writes for a message's calls parses back to
    the same calls (typed by their schema) and content, and the template writes the parsed message again
    to the same text."""
    codec = ChatCodec(tiny.processor, chat_template=XML_TOOLS_CHAT_TEMPLATE)
    tools = [t for name, args in calls for t in tools_for(name, args)]
    # one schema per name: a repeated name takes the properties of every call of it
    merged: dict[str, dict[str, Any]] = {}
    for t in tools:
        fn = t["function"]
        merged.setdefault(fn["name"], {}).update(fn["parameters"]["properties"])
    # two calls of one name that disagree on a parameter's type: no single schema types both
    assume(all(schema_of(a[k]) == merged[n][k] for n, a in calls for k in a))
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"properties": p}}}
        for n, p in merged.items()
    ]

    def assistant_text(message: dict[str, Any]) -> str:
        msgs = chat_to_messages([{"role": "user", "content": "go"}, message])
        text = codec.template_text(msgs, tools, add_generation_prompt=False)
        return text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") :].removesuffix(
            "<|im_end|>\n"
        )

    def message(content: str, parsed_calls: list[tuple[str, str]]) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(parsed_calls)
            ],
        }

    generated = assistant_text(message(content, [(n, json.dumps(a)) for n, a in calls]))
    parsed = codec.parse_text(generated, tools)
    assert parsed.unparsed_tool_calls == [] and parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    again = assistant_text(message(parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]))
    assert again == generated


@pytest.mark.parametrize("xml", [True, False], ids=["qwen3_coder", "hermes"])
def test_the_next_turn_rebuilt_from_the_parsed_items_extends_what_the_model_emitted(
    tiny: Any, xml: bool
) -> None:
    """The conversation rebuilt from the parsed output items (without replayed tokens) renders the
    model's own tokens for that turn, so re-templating history changes nothing the trainer scores."""
    codec = ChatCodec(tiny.processor, chat_template=XML_TOOLS_CHAT_TEMPLATE if xml else None)
    fmt = XML if xml else HERMES
    assert codec.tool_parser == fmt.name
    first = [{"role": "user", "content": "Zoom on the car, then answer."}]
    prompt = codec.render(responses_to_messages(first), ZOOM_TOOLS).prompt_token_ids
    emitted = "I will zoom.\n\n" if xml else "I will zoom.\n"
    # (no boolean: this template writes Jinja's True, the canonical render JSON's true; both parse)
    emitted += fmt.render("zoom", {"bbox": [1.5, 2, 30, 40], "label": "red car", "steps": 2, "note": "x"})
    emitted += "\n" + fmt.render("answer", {"text": "two lines\nof text"})
    generated = [*codec.tokenizer(emitted, add_special_tokens=False)["input_ids"], codec.end_of_turn_id]
    parsed = codec.parse(generated, ZOOM_TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["zoom", "answer"] and parsed.unparsed_tool_calls == []
    gen = Generation(token_ids=generated, logprobs=[0.0] * len(generated), finish_reason="stop")
    items = response_items(parsed, gen, prompt)
    plain = [{k: v for k, v in i.items() if not k.endswith(("token_ids", "log_probs"))} for i in items]
    outputs = [
        {"type": "function_call_output", "call_id": i["call_id"], "output": "ok"}
        for i in items
        if i["type"] == "function_call"
    ]
    for replayed in (plain, items):
        rendered = codec.render(responses_to_messages([*first, *replayed, *outputs]), ZOOM_TOOLS)
        assert rendered.spliced == (replayed is items)
        assert rendered.prompt_token_ids[: len(prompt) + len(generated)] == [*prompt, *generated]


# ---------------------------------------------------------------- auto and naming a format


def test_auto_picks_hermes_for_every_tiny_family() -> None:
    from gymbridge.models.tiny_families import TINY_FAMILIES, tiny_model

    picked = {family: ChatCodec(tiny_model(family).processor).tool_parser for family in TINY_FAMILIES}
    assert picked == dict.fromkeys(TINY_FAMILIES, "hermes")


def test_auto_reads_the_chat_template(tiny: Any) -> None:
    assert ChatCodec(tiny.processor, chat_template=XML_TOOLS_CHAT_TEMPLATE).tool_parser == "qwen3_coder"
    assert detect_tool_parser(XML_TOOLS_CHAT_TEMPLATE) == "qwen3_coder"
    assert detect_tool_parser("{{ '<tool_call>' }}{{ tool_call | tojson }}") == "hermes"
    assert detect_tool_parser(None) == detect_tool_parser("{{ messages }}") == "hermes"  # the fallback
    assert detect_tool_parser({"default": "x", "tool_use": "<parameter=a>"}) == "qwen3_coder"
    assert resolve_tool_parser("hermes", XML_TOOLS_CHAT_TEMPLATE) == "hermes"  # a named one wins
    assert ChatCodec(tiny.processor, tool_parser="qwen3_coder").tool_parser == "qwen3_coder"
    off = ChatCodec(tiny.processor, tool_parser=None)
    text = '<tool_call>{"name": "a"}</tool_call>'
    assert off.tool_parser is None and off.parse_text(text).content == text
    assert set(TOOL_PARSERS) == {"auto", "hermes", "qwen3_coder"}
    with pytest.raises(ValueError, match="unknown tool-call format 'pythonic'"):
        ChatCodec(tiny.processor, tool_parser="pythonic")


def test_the_setting_reaches_the_generators_and_the_child_server() -> None:
    import argparse

    from pydantic import ValidationError

    from gymbridge.generation.cli import add_model_commands
    from gymbridge.run.generator_process import tiny_server_command
    from gymbridge.run.placement import GeneratorConfig

    assert GeneratorConfig().tool_parser == "auto"
    assert GeneratorConfig(tool_parser="qwen3_coder").tool_parser == "qwen3_coder"
    with pytest.raises(ValidationError):
        GeneratorConfig(tool_parser="pythonic")  # type: ignore[arg-type]
    common = {"seed": 0, "max_model_len": 64, "default_max_tokens": 8, "prompt_seed": None}
    assert "--tool-parser" not in tiny_server_command(**common, enable_weight_updates=False)
    command = tiny_server_command(**common, enable_weight_updates=False, tool_parser="qwen3_coder")
    assert command[command.index("--tool-parser") + 1] == "qwen3_coder"
    parser = argparse.ArgumentParser()
    add_model_commands(parser.add_subparsers())
    args = parser.parse_args(["serve", *command[command.index("serve") + 1 :]])
    assert args.tool_parser == "qwen3_coder"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tiny", "--tool-parser", "pythonic"])
    assert HFGenerator.tiny(0, tool_parser="qwen3_coder").codec.tool_parser == "qwen3_coder"


def test_the_vllm_backend_parses_in_the_named_format(monkeypatch: pytest.MonkeyPatch, tiny: Any) -> None:
    import types

    from gymbridge.generation import vllm as vllm_backend

    fake = types.ModuleType("vllm")
    fake.AsyncEngineArgs = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    engine = types.SimpleNamespace()  # only its absent model_config is read here
    auto = vllm_backend.VLLMGenerator("tiny", engine=engine, processor=tiny.processor)
    named = vllm_backend.VLLMGenerator(
        "tiny", engine=engine, processor=tiny.processor, tool_parser="qwen3_coder"
    )
    assert (auto.codec.tool_parser, named.codec.tool_parser) == ("hermes", "qwen3_coder")
    generated = call_tokens(named, XML_ZOOM)
    assert [c.name for c in named.codec.parse(generated, ZOOM_TOOLS).tool_calls] == ["zoom"]


# ---------------------------------------------------------------- the model server and the native loop


def counter_row(target: int) -> dict[str, Any]:
    from gymbridge.server.examples import counter_rows

    row = counter_rows(1)[0]
    row["target"] = target
    row["responses_create_params"] = {
        **row["responses_create_params"],
        "temperature": 0.8,
        "max_output_tokens": 8,
    }
    return row


async def run_counter(generator: Any, row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """One ``/run`` through gymbridge's SimpleAgent and a ModelServer over ``generator``; its counters."""
    from gymbridge.server import SimpleAgent, start_server
    from gymbridge.server.examples import CounterEnv

    config = ModelServerConfig(model_name="tiny-xml", max_model_len=2048, batching=False)
    async with (
        await start_server(CounterEnv()) as env,
        ModelServer(generator, config=config) as server,
    ):
        agent = SimpleAgent(resources_url=env.url, model_url=str(server.url), max_steps=3)
        async with await start_server(agent) as running, httpx.AsyncClient(timeout=120) as http:
            reply = await http.post(f"{running.url}/run", json=row)
            counters = (await http.get(f"{server.url}/counters")).json()
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result, counters


@pytest.mark.integration
async def test_an_xml_call_from_the_model_server_reaches_the_environment(tiny: Any) -> None:
    gen = xml_tools_generator(tiny)
    assert gen.codec.tool_parser == "qwen3_coder"
    script = [call_tokens(gen, xml_block("increment", ("amount", "2"))), call_tokens(gen, "done")]
    result, counters = await run_counter(ScriptedGenerator(gen, script), counter_row(2))
    calls = [i for i in result["response"]["output"] if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("increment", {"amount": 2})]
    assert result["final_count"] == 2 and result["reward"] == pytest.approx(1.0)
    assert counters["tool_calls_parsed"] == 1 and counters["tool_calls_unparsed"] == 0


@pytest.mark.integration
async def test_an_unparsed_xml_call_is_a_scored_message_that_says_why(tiny: Any) -> None:
    gen = xml_tools_generator(tiny)
    broken = "<tool_call>\n<function=increment>\n<parameter=amount>\n2\n</function>\n</tool_call>"
    result, counters = await run_counter(ScriptedGenerator(gen, [call_tokens(gen, broken)]), counter_row(2))
    output = result["response"]["output"]
    assert [i["type"] for i in output] == ["message"]  # no call reached the environment
    assert result["final_count"] == 0 and result["reward"] == pytest.approx(0.2)  # scored, not dropped
    assert not result.get("mask_sample")
    (error,) = output[0]["tool_call_errors"]
    assert error["kind"] == "tool_call_unparsed" and error["format"] == "qwen3_coder"
    assert "<parameter=amount> is never closed" in error["reason"] and error["markup"] == broken
    assert output[0]["content"][0]["text"] == broken
    assert counters["tool_calls_unparsed"] == 1 and counters["tool_calls_parsed"] == 0
    # the keys each step's metrics.jsonl record gets from the model server counters' delta
    from gymbridge.run.timing import generator_keys

    keys = generator_keys(counters)
    assert keys == {"generator/tool_calls_parsed": 0.0, "generator/tool_calls_unparsed": 1.0}
    assert generator_keys({}) == {}  # no model server counters (native rollouts): absent, not 0


@pytest.mark.integration
async def test_chat_completions_carry_xml_calls_and_unparsed_reasons(tiny: Any) -> None:
    gen = xml_tools_generator(tiny)
    broken = "<tool_call>\n<function=zoom>\n</tool_call>"
    script = [call_tokens(gen, "Zooming.\n\n" + XML_ZOOM), call_tokens(gen, broken)]
    config = ModelServerConfig(model_name="tiny-xml", max_model_len=2048, batching=False)
    async with ModelServer(ScriptedGenerator(gen, script), config=config) as server:
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"messages": [{"role": "user", "content": "zoom"}], "tools": ZOOM_TOOLS, "max_tokens": 8}
            first = (await http.post(f"{server.url}/v1/chat/completions", json=body)).json()["choices"][0]
            second = (await http.post(f"{server.url}/v1/chat/completions", json=body)).json()["choices"][0]
        counters = server.counters()
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "Zooming."
    (call,) = first["message"]["tool_calls"]
    assert call["function"]["name"] == "zoom" and json.loads(call["function"]["arguments"])["bbox"] == [
        10,
        20,
        110,
        220,
    ]
    assert "tool_call_errors" not in first["message"]
    assert second["message"]["tool_calls"] == [] and second["message"]["content"] == broken
    assert second["message"]["tool_call_errors"][0]["kind"] == "tool_call_unparsed"
    assert (counters["tool_calls_parsed"], counters["tool_calls_unparsed"]) == (1, 1)


@pytest.mark.integration
async def test_the_native_loop_parses_xml_calls_with_the_rows_tools(tiny: Any) -> None:
    from gymbridge.generation.types import SamplingConfig
    from gymbridge.rollout import NativeModel, run_episode
    from gymbridge.server import start_server
    from gymbridge.server.examples import CounterEnv

    gen = xml_tools_generator(tiny)
    scripted = ScriptedGenerator(gen, [call_tokens(gen, xml_block("increment", ("amount", "3"))), None])
    sampling = SamplingConfig(temperature=0.8, max_tokens=4, seed=7)
    model = NativeModel(scripted, gen.codec, max_model_len=2048, sampling=sampling)
    async with await start_server(CounterEnv()) as env:
        result = await run_episode(scripted, env.url, counter_row(3), max_turns=2, model=model, mode="tools")
    calls = [i for i in result["response"]["output"] if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("increment", {"amount": 3})]
    assert result["final_count"] == 3


# ---------------------------------------------------------------- the peers' parsers


def run_peer(python: Path, peer: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    proc = subprocess.run(
        [str(python), str(PEERS), peer],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def need_venv(problem: str | None, required: bool, suite: str) -> None:
    """Skip without the peer's venv; fail instead where CI requires the suite (``GYMBRIDGE_REQUIRE_*``)."""
    if problem is None:
        return
    if required:
        pytest.fail(f"{suite} is required but cannot run: {problem}", pytrace=False)
    pytest.skip(f"{suite} skipped: {problem}")


PEER_GOLDEN = [
    XML_ZOOM,
    "I will zoom in on the car.\n\n" + xml_block("zoom", ("bbox", "[0, 0, 5, 5]"), ("label", "car")),
    xml_block("zoom", ("steps", "1")) + "\n" + xml_block("answer", ("text", "two\nlines")),
    xml_block("crop", ("box", "[1, 2, 3, 4]"), ("n", "42"), ("flag", "false"), ("name", "left half")),
]


@pytest.mark.gym
def test_qwen3_coder_agrees_with_genuine_nemo_gym() -> None:
    """Genuine 0.7.0's ``parse_image_tool_calls`` (no schema: JSON-like values) extracts what we parse
    without tools; markup it calls malformed we report as ``tool_call_unparsed``."""
    import _genuine

    need_venv(_genuine.gym_venv_problem(), _genuine.REQUIRE_GYM, "the gym suite")
    malformed = [
        "<tool_call>\n<function=zoom>\n<parameter=steps>\n3\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=zoom>\n<parameter=steps>\n3\n</parameter>\n</function>",
        "<function=zoom>\n<parameter=steps>\n3\n</parameter>\n</function>",
    ]
    cases = [{"format": "qwen3_coder", "text": t, "tools": None} for t in [*PEER_GOLDEN, *malformed]]
    genuine = run_peer(_genuine.GYM_PYTHON, "gym", cases)
    for case, theirs in zip(cases, genuine, strict=True):
        ours = XML.parse(case["text"])
        assert [[c.name, json.loads(c.arguments)] for c in ours.calls] == theirs["calls"], case["text"]
        assert bool(ours.unparsed) == theirs["malformed"], case["text"]


@pytest.mark.vllm
def test_tool_parsers_agree_with_vllm() -> None:
    """vLLM 0.33's ``qwen3_coder`` (schema-typed values) and ``hermes`` parsers, run in ``.venv-vllm`` on
    CPU, extract the calls and the content we parse with the same tools."""
    import _vllm_venv

    need_venv(_vllm_venv.vllm_venv_problem(), _vllm_venv.REQUIRE_VLLM, "the vllm suite")
    cases = [
        {"format": "qwen3_coder", "text": t, "tools": [*ZOOM_TOOLS[:1], ANSWER_TOOL]} for t in PEER_GOLDEN[:3]
    ]
    cases += [{"format": "hermes", "text": t, "tools": ZOOM_TOOLS[:1]} for _, t, _, _ in HERMES_GOLDEN[:2]]
    theirs_all = run_peer(_vllm_venv.VLLM_PYTHON, "vllm", cases)
    for case, theirs in zip(cases, theirs_all, strict=True):
        ours = tool_call_format(case["format"]).parse(case["text"], case["tools"])
        assert [[c.name, json.loads(c.arguments)] for c in ours.calls] == theirs["calls"], case["text"]
        # vLLM's hermes parser keeps the newline before the call; ours strips the content around calls
        assert ours.content == (theirs["content"] or "").strip(), case["text"]


def test_tool_call_is_still_importable_from_chat() -> None:
    from gymbridge.generation import chat

    assert chat.ToolCall is ToolCall and "ToolCall" in chat.__all__ and "new_call_id" in chat.__all__
