"""V4.1 through vLLM's OpenAI server as a user runs it (README "Serving"): the ``openai``
example, forced tool calls and JSON answers that always validate, on random weights.

One server on ``tiny`` with ``--reasoning-parser deepseek_v41 --tool-call-parser
deepseek_v41 --enable-auto-tool-choice``: the README's (``readme_server``; the ``openai``
example runs against it in ``test_readme.py``). Random weights write strings forever, so the
schemas bound strings (``maxLength``) and numbers (``minimum``/``maximum``); requests
get ``max_tokens`` room to finish, and every response is checked: it finishes
(``finish_reason``), parses with a strict ``json.loads`` and passes ``jsonschema``.
With thinking on (V4.1's chat default), ``thinking_token_budget`` ends the thinking.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from readme import README_GROUP

pytestmark = pytest.mark.xdist_group(README_GROUP)

ROOM = 512  # max_tokens: a constrained answer of these schemas is far shorter
# Parallel calls: after each call the grammar lets the model end the list or call again, about
# evenly on random weights, so the number of calls is geometric; this room makes a cut-off
# (about 15 calls) unlikely beyond 1e-4 per request.
CALLS_ROOM = 1400
THINK_BUDGET = 12

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city for the next days",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "number", "minimum": -100, "maximum": 100},
                    "b": {"type": "number", "minimum": -100, "maximum": 100},
                },
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 20},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 10},
                    "safe": {"type": "boolean"},
                },
                "required": ["query", "safe"],
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

JSON_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 2, "maxLength": 12},
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "kind": {"type": "string", "enum": ["sunny", "rain", "snow"]},
            "hourly": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["city", "temperature", "kind", "hourly"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 10},
            "author": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 6},
                    "born": {"type": "integer", "minimum": 1900, "maximum": 2026},
                },
                "required": ["first", "born"],
                "additionalProperties": False,
            },
            "pages": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 999}, {"type": "null"}]},
        },
        "required": ["title", "author", "pages"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def server(readme_server):
    """The README's own server (tests/e2e/conftest.py): ``vllm serve build/tiny`` with the flags
    above, started word for word from the README in a fresh shell."""
    return readme_server


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key="EMPTY", timeout=600)


def _thinking(on: bool) -> dict:
    return {"thinking_token_budget": THINK_BUDGET} if on else {"chat_template_kwargs": {"thinking": False}}


def _collect_stream(stream) -> tuple[str | None, str, str, list[tuple[str, str]]]:
    """(finish_reason, reasoning, content, [(name, arguments)]) of a streamed chat."""
    finish, reasoning, content, calls = None, "", "", {}
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            if call.function is not None:
                name += call.function.name or ""
                args += call.function.arguments or ""
            calls[call.index] = (name, args)
        finish = choice.finish_reason or finish
    return finish, reasoning, content, [calls[i] for i in sorted(calls)]


def _tool_request(client, choice, thinking: bool, stream: bool, seed: int):
    named = isinstance(choice, str) and choice != "required"
    tool_choice = {"type": "function", "function": {"name": choice}} if named else choice
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Plan a trip: weather, sums and a search."}],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=CALLS_ROOM,
        temperature=1.0,
        seed=seed,
        extra_body=_thinking(thinking),
    )
    if seed % 2:
        kwargs["parallel_tool_calls"] = False
    if stream:
        return _collect_stream(client.chat.completions.create(stream=True, **kwargs))
    response = client.chat.completions.create(**kwargs)
    message = response.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return (
        response.choices[0].finish_reason,
        getattr(message, "reasoning", None) or "",
        message.content or "",
        calls,
    )


@pytest.mark.parametrize("thinking", [False, True], ids=["no_thinking", "thinking"])
def test_forced_tool_calls_follow_the_tool_schemas(client, thinking):
    cases = [
        (choice, stream, seed)
        for choice in ("required", "add", "search")
        for stream in (False, True)
        for seed in range(4 if choice == "required" else 2)
    ]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: _tool_request(client, c[0], thinking, c[1], c[2]), cases))
    for (choice, stream, seed), (finish, reasoning, content, calls) in zip(cases, results):
        where = f"choice={choice} stream={stream} seed={seed}: {finish} {calls} {content!r}"
        # OpenAI's convention, which vLLM follows: "tool_calls" for required, "stop" for a named tool.
        assert finish == ("tool_calls" if choice == "required" else "stop"), where
        assert calls and not content.strip(), where
        if seed % 2:
            assert len(calls) == 1, where  # parallel_tool_calls=False
        for name, arguments in calls:
            assert name in SCHEMAS and (choice == "required" or name == choice), where
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])  # every required parameter, in bounds
        assert bool(reasoning) == thinking, where


def _json_request(client, schema, thinking: bool, stream: bool, seed: int, room: int = ROOM):
    response_format = (
        {"type": "json_object"}
        if schema is None
        else {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    )
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format=response_format,
        max_tokens=room,
        temperature=1.0,
        seed=seed,
        extra_body=_thinking(thinking),
    )
    if stream:
        finish, reasoning, content, _ = _collect_stream(client.chat.completions.create(stream=True, **kwargs))
        return finish, reasoning, content
    response = client.chat.completions.create(**kwargs)
    message = response.choices[0].message
    return response.choices[0].finish_reason, getattr(message, "reasoning", None) or "", message.content or ""


def test_json_schema_answers_validate_with_the_default_backend(client):
    """56 requests (xgrammar, vLLM's default backend): every answer finishes and validates."""
    cases = [(i % len(JSON_SCHEMAS), i % 4 == 3, i % 3 == 2, i) for i in range(56)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: _json_request(client, JSON_SCHEMAS[c[0]], c[1], c[2], c[3]), cases))
    for (schema_index, thinking, stream, seed), (finish, reasoning, content) in zip(cases, results):
        where = f"schema={schema_index} thinking={thinking} stream={stream} seed={seed}: {finish} {content!r}"
        assert finish == "stop", where
        value = json.loads(content)  # strict: raw control characters in strings are refused
        jsonschema.validate(value, JSON_SCHEMAS[schema_index])
        assert re.search(r"\s{17}", content) is None, where  # DEEPINFER_GRAMMAR_MAX_WHITESPACE=16
        assert bool(reasoning) == thinking, where  # with thinking on, JSON comes after the reasoning


def test_json_object_answers_that_finish_are_json_objects(client):
    """``json_object`` has no bounds for random weights to stop at (a key can run past any
    ``max_tokens``); a cut answer says ``length``, and every finished one is an object."""
    # One at a time: seeded answers are the same in every run only alone (a batch changes the
    # logits' bits), and at least one of these seeds must finish. A finished answer is short
    # (seeds 0 and 3-6 wrote `{}` in 3 tokens); a cut one runs to max_tokens, so 64 do.
    results = [_json_request(client, None, False, False, seed, room=64) for seed in range(8)]
    finished = [content for finish, _, content in results if finish == "stop"]
    assert all(finish in ("stop", "length") for finish, _, _ in results), results
    assert finished, results
    for content in finished:
        assert isinstance(json.loads(content), dict), content


def test_responses_api_with_the_openai_client(client):
    """``/v1/responses``: reasoning comes back as a reasoning item; forced calls (thinking
    off through ``reasoning.effort: none``) follow the tool schema; with thinking on, vLLM
    0.32's Responses API has no thinking budget, so random weights think until
    ``max_output_tokens`` and the response says ``incomplete`` (README)."""
    pool = ThreadPoolExecutor(4)  # the four requests side by side: one batch on the server
    reasoning_future = pool.submit(
        client.responses.create, model="tiny", input="Hello", max_output_tokens=24, reasoning={"effort": "low"}
    )
    text_future = pool.submit(
        client.responses.create, model="tiny", input="Hello", max_output_tokens=12, reasoning={"effort": "none"}
    )
    tools = [
        {
            "type": "function",
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "parameters": t["function"]["parameters"],
            "strict": None,
        }
        for t in TOOLS
    ]
    choices = ("required", {"type": "function", "name": "search"})
    forced = [
        pool.submit(
            client.responses.create,
            model="tiny",
            input="Plan a trip.",
            tools=tools,
            tool_choice=tool_choice,
            max_output_tokens=CALLS_ROOM,
            reasoning={"effort": "none"},
            temperature=1.0,
        )
        for tool_choice in choices
    ]
    pool.shutdown()

    reasoning = reasoning_future.result()
    item = reasoning.output[0]
    assert item.type == "reasoning" and item.content[0].text.strip()
    assert reasoning.status == "incomplete" and reasoning.incomplete_details.reason == "max_output_tokens"
    for tool_choice, future in zip(choices, forced):
        response = future.result()
        calls = [item for item in response.output if item.type == "function_call"]
        assert response.status == "completed" and calls, response.output
        for call in calls:
            assert tool_choice == "required" or call.name == "search"
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    text = text_future.result()
    assert [item.type for item in text.output] == ["message"] and text.output_text.strip()


def test_messages_api_with_the_anthropic_client(server):
    """``/v1/messages``: ``thinking`` enabled returns a thinking block bounded by its
    ``budget_tokens`` (Anthropic's minimum, 1024) and then the forced call; disabled
    returns text or calls directly; streaming gives the same kind of message."""
    import anthropic

    messages = anthropic.Anthropic(base_url=server[0], api_key="EMPTY", timeout=900).messages
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    ask = [{"role": "user", "content": "Plan a trip."}]

    pool = ThreadPoolExecutor(4)  # side by side: one batch on the server
    thought_future = pool.submit(
        messages.create,
        model="tiny",
        max_tokens=1400,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "add"},
        thinking={"type": "enabled", "budget_tokens": 1024},
    )

    def streamed():
        with messages.stream(
            model="tiny",
            max_tokens=CALLS_ROOM,
            messages=ask,
            tools=tools,
            tool_choice={"type": "any"},
            thinking={"type": "disabled"},
        ) as stream:
            return stream.get_final_message()

    final_future = pool.submit(streamed)
    plain_future = pool.submit(messages.create, model="tiny", max_tokens=12, messages=ask, thinking={"type": "disabled"})
    short_future = pool.submit(messages.create, model="tiny", max_tokens=4, messages=ask, thinking={"type": "disabled"})
    pool.shutdown()

    thought = thought_future.result()
    kinds = [block.type for block in thought.content]
    assert kinds[0] == "thinking" and thought.content[0].thinking.strip(), kinds
    uses = [block for block in thought.content if block.type == "tool_use"]
    assert thought.stop_reason == "tool_use" and uses and all(u.name == "add" for u in uses), thought
    for use in uses:
        jsonschema.validate(use.input, SCHEMAS["add"])

    final = final_future.result()
    assert final.stop_reason == "tool_use" and final.content, final
    for block in final.content:
        assert block.type == "tool_use", final
        jsonschema.validate(block.input, SCHEMAS[block.name])

    plain = plain_future.result()
    assert [block.type for block in plain.content] == ["text"] and plain.stop_reason == "max_tokens"
    bad = pytest.raises(anthropic.BadRequestError)
    with bad:  # Anthropic's own rule, enforced by vLLM: a budget below 1024 is a 400
        messages.create(
            model="tiny", max_tokens=64, messages=ask, thinking={"type": "enabled", "budget_tokens": 12}
        )
    assert short_future.result().content


def test_bad_schemas_are_400s_and_the_server_keeps_serving(server):
    import requests

    url = f"{server[0]}/v1/chat/completions"
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8,
        "chat_template_kwargs": {"thinking": False},
    }
    lookbehind = {
        "type": "function",
        "function": {
            "name": "find",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}},
                "required": ["x"],
            },
        },
    }
    r = requests.post(url, json=ask | {"tools": [lookbehind], "tool_choice": "required"}, timeout=300)
    assert r.status_code == 400 and "'find'" in r.json()["error"]["message"], r.text
    bad_json = {
        "type": "json_schema",
        "json_schema": {
            "name": "a",
            "schema": {"type": "object", "properties": {"x": {"type": "string", "maxLength": "abc"}}},
        },
    }
    r = requests.post(url, json=ask | {"response_format": bad_json}, timeout=300)
    assert r.status_code == 400 and "maxLength" in r.json()["error"]["message"], r.text
    r = requests.post(url, json=ask, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


# -- Forced tool calls cut by max_tokens, and schema keywords the grammar cannot enforce ---------

INVOKE_END = "</｜DSML｜ invoke>"
CUT_ROOM = 200  # max_tokens: on `tiny` a forced call takes 60-140 tokens, so 200 cuts most outputs mid-call


def _raw_text(tiny_checkpoint, token_ids) -> str:
    """The DSML the model wrote (the server's ``return_token_ids``), decoded independently."""
    return _checkpoint_tokenizer(tiny_checkpoint).decode(token_ids)


_TOKENIZERS: dict = {}


def _checkpoint_tokenizer(path):
    from transformers import AutoTokenizer

    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    return _TOKENIZERS[path]


def _cut_request(server, seed: int, stream: bool):
    """A forced call (``required``) with ``CUT_ROOM`` tokens, over plain HTTP with
    ``return_token_ids``: (finish_reason, completion tokens, token ids, [(name, arguments)],
    [(index, token ids streamed up to and with the delta naming that call)])."""
    import requests

    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Plan a trip: weather, sums and a search."}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": CUT_ROOM,
        "temperature": 1.0,
        "seed": seed,
        "chat_template_kwargs": {"thinking": False},
        "return_token_ids": True,
    }
    url = f"{server[0]}/v1/chat/completions"
    if not stream:
        r = requests.post(url, json=body, timeout=900)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"].get("tool_calls") or []
        ]
        return choice["finish_reason"], r.json()["usage"]["completion_tokens"], choice["token_ids"], calls, []
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    finish, used, token_ids, calls, named = None, None, [], {}, []
    with requests.post(url, json=body, timeout=900, stream=True) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                token_ids += choice.get("token_ids") or []
                for call in choice["delta"].get("tool_calls") or []:
                    name, args = calls.get(call["index"], ("", ""))
                    function = call.get("function") or {}
                    calls[call["index"]] = (
                        name + (function.get("name") or ""),
                        args + (function.get("arguments") or ""),
                    )
                    named.append((call["index"], list(token_ids)))
                finish = choice.get("finish_reason") or finish
    return finish, used, token_ids, [calls[i] for i in sorted(calls)], named


def test_forced_calls_cut_by_max_tokens_return_only_whole_calls(server, tiny_checkpoint):
    """``max_tokens`` ends most of these forced calls mid-way. Checked against the DSML the
    model wrote (``return_token_ids``, decoded here): the response lists exactly the calls
    whose ``</｜DSML｜ invoke>`` was written, in order, each passing strict ``json.loads`` and
    the tool schema; a cut output says ``length``; streamed, no delta names a call before its
    end tag was streamed."""
    # One at a time: these seeds cut a call when run alone; in a batch the logits' bits, and so
    # the seeded samples, differ.
    cases = [(seed, stream) for seed in (1, 2) for stream in (False, True)]
    results = [_cut_request(server, seed, stream) for seed, stream in cases]
    cut = 0
    for (seed, stream), result in zip(cases, results):
        finish, used, token_ids, calls, named = result
        raw = _raw_text(tiny_checkpoint, token_ids)
        where = f"seed={seed} stream={stream}: {finish} {used} {calls} {raw!r}"
        assert len(token_ids) == used, where
        closed = raw.count(INVOKE_END)
        written = re.findall(r'<｜DSML｜ invoke name="([^"]+)">', raw)
        assert [name for name, _ in calls] == written[:closed], where  # whole calls only, all of them
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        complete = "</｜DSML｜ calls>" in raw  # the grammar ends the output there
        assert finish == ("tool_calls" if complete else "length"), where
        if not complete:
            assert used == CUT_ROOM, where
        cut += len(written) > closed
        for index, streamed in named:  # held back until closed
            assert _raw_text(tiny_checkpoint, streamed).count(INVOKE_END) > index, where
        if stream:
            assert len(named) == len(calls), where  # one delta per call, sent whole
    assert cut, "no output was cut inside a call: raise the seeds or lower CUT_ROOM"


def test_schema_keywords_the_grammar_cannot_enforce_are_400s(server):
    """``uniqueItems`` and ``format`` + ``maxLength`` (xgrammar ignores both) in a
    ``response_format`` and in a forced call's tool schema: a 400 naming the keyword and
    its JSON path (and the tool), before any generation; the server keeps serving."""
    import requests

    url = f"{server[0]}/v1/chat/completions"
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8,
        "chat_template_kwargs": {"thinking": False},
    }
    unique = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        "required": ["tags"],
    }
    email = {
        "type": "object",
        "properties": {"email": {"type": "string", "format": "email", "maxLength": 30}},
        "required": ["email"],
    }
    for schema, keyword, path in [
        (unique, "uniqueItems", "$.properties.tags"),
        (email, "maxLength", "$.properties.email"),
    ]:
        response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        r = requests.post(url, json=ask | {"response_format": response_format}, timeout=300)
        assert r.status_code == 400 and f"`{keyword}` at {path}" in r.json()["error"]["message"], r.text
        tool = {"type": "function", "function": {"name": "book", "parameters": schema}}
        r = requests.post(url, json=ask | {"tools": [tool], "tool_choice": "required"}, timeout=300)
        message = r.json()["error"]["message"] if r.status_code == 400 else r.text
        assert r.status_code == 400 and "tool 'book'" in message and f"`{keyword}` at {path}" in message, (
            r.text
        )
    r = requests.post(url, json=ask, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
