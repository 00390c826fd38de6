"""DeepSeek-V4.1 through vLLM's OpenAI-compatible server, with the ``openai`` client.

Start the server (README "Serving"), then run this against it:

    vllm serve build/tiny --served-model-name tiny \\
        --reasoning-parser deepseek_v41 --tool-call-parser deepseek_v41 --enable-auto-tool-choice
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --model tiny

It asks for: a plain chat answer (thinking off), a thinking answer (reasoning
returned apart from the content, bounded by ``thinking_token_budget``), a forced
tool call, and a JSON answer that follows a schema (those two get room to finish:
the grammar holds every token, so a call or object cut short by ``max_tokens`` is
the only way to get one that does not parse).
"""

from __future__ import annotations

import argparse
import json

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key="EMPTY")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    no_thinking = {"chat_template_kwargs": {"thinking": False}}  # V4.1 chat defaults to thinking

    chat = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=args.max_tokens, extra_body=no_thinking
    )
    print(f"chat: {chat.choices[0].message.content!r}")

    thinking = client.chat.completions.create(
        model=args.model,
        messages=messages,
        max_tokens=args.max_tokens,
        extra_body={"thinking_token_budget": 16},
    )
    message = thinking.choices[0].message
    print(f"reasoning: {getattr(message, 'reasoning', None)!r}")
    print(f"answer: {message.content!r}")

    call = client.chat.completions.create(
        model=args.model,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=512,
        extra_body=no_thinking,
    )
    tool_call = call.choices[0].message.tool_calls[0]
    function = tool_call.function
    print(f"tool call ({call.choices[0].finish_reason}): {function.name} {function.arguments}")

    person = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
        max_tokens=512,
        extra_body=no_thinking,
    )
    answer = json.loads(person.choices[0].message.content)
    print(f"json ({person.choices[0].finish_reason}): {json.dumps(answer)}")


if __name__ == "__main__":
    main()
