"""The request options matrix, run against a live OpenAI server on every platform the plugin
serves (one CPU rank, CPU TP=2, the simulated NPU): each option either answers, checked
against what the option promises, or is refused by name with a 4xx; after every case the
engine still serves a plain request.

Outcomes are checked against the same server's own plain greedy answer (the reference
tokens of these engines are checked elsewhere), so the matrix holds in bf16 and fp32 alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import requests

PROMPT = "The weather in Paris today is"
NEW = 8
TIMEOUT = 600


@dataclass
class Server:
    url: str
    model: str = "tiny"
    refused: dict[str, str] = field(default_factory=dict)  # case -> why it is a 4xx here

    def post(self, path: str, body: dict) -> requests.Response:
        return requests.post(f"{self.url}{path}", json={"model": self.model, **body}, timeout=TIMEOUT)

    plain: list[int] = field(default_factory=list)  # the plain greedy answer's tokens

    def complete(self, **body) -> dict:
        """A completion; a 4xx raises ``Refused`` with its status and message."""
        return _maybe_refused(self.post("/v1/completions", {"prompt": PROMPT, "max_tokens": NEW, **body}))

    def alive(self) -> None:
        """The engine still serves: a plain greedy request gives the plain greedy tokens."""
        assert self.complete(temperature=0, return_token_ids=True)["choices"][0]["token_ids"] == self.plain


def _choice(out: dict) -> dict:
    return out["choices"][0]


def run_matrix(server: Server) -> dict[str, str]:
    """Every case; returns ``{case: "answered" | "refused: <status> <message>"}``."""
    plain = server.complete(temperature=0, return_token_ids=True, ignore_eos=True)
    server.plain = _choice(plain)["token_ids"]
    assert len(server.plain) == NEW
    outcomes: dict[str, str] = {}
    for name, case in CASES.items():
        try:
            case(server)
            outcomes[name] = "answered"
        except Refused as refused:
            outcomes[name] = f"refused: {refused}"
            assert name in server.refused, f"{name} refused on this platform: {refused}"
        server.alive()
    for name in server.refused:
        assert outcomes[name].startswith("refused"), f"{name} was expected to be refused, and answered"
    return outcomes


class Refused(Exception):
    pass


def _maybe_refused(r: requests.Response) -> dict:
    if 400 <= r.status_code < 500:
        message = r.json().get("error", {}).get("message", r.text) if r.text else ""
        raise Refused(f"{r.status_code} {message[:300]}")
    assert r.status_code == 200, (r.status_code, r.text[:2000])
    return r.json()


def case_logprobs(s: Server) -> None:
    c = _choice(s.complete(temperature=0, logprobs=3, ignore_eos=True))
    tops = c["logprobs"]["top_logprobs"]
    assert len(tops) == NEW and all(3 <= len(t) <= 4 for t in tops)
    # Greedy: each sampled token is the most likely one of its position.
    for tok_lp, top in zip(c["logprobs"]["token_logprobs"], tops):
        assert tok_lp >= max(top.values()) - 1e-6


def case_prompt_logprobs(s: Server) -> None:
    c = _choice(s.complete(temperature=0, prompt_logprobs=2, return_token_ids=True, ignore_eos=True))
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(c["prompt_token_ids"])
    for pos in range(1, len(plp)):
        assert str(c["prompt_token_ids"][pos]) in plp[pos]  # the prompt token itself, plus the top 2
        assert all(v["logprob"] <= 0 for v in plp[pos].values())
    assert c["token_ids"] == s.plain


def case_echo(s: Server) -> None:
    c = _choice(s.complete(temperature=0, echo=True, logprobs=1, ignore_eos=True))
    assert c["text"].startswith(PROMPT) and len(c["text"]) > len(PROMPT)
    assert c["logprobs"]["token_logprobs"][0] is None  # the first prompt token has none


def case_n(s: Server) -> None:
    out = s.complete(temperature=1.0, n=3, seed=5, ignore_eos=True, return_token_ids=True)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
    assert all(len(c["token_ids"]) == NEW for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 3 * NEW


def case_seed(s: Server) -> None:
    a, b, c = (
        _choice(s.complete(temperature=1.0, seed=seed, ignore_eos=True, return_token_ids=True))["token_ids"]
        for seed in (11, 11, 12)
    )
    assert a == b, "the same seed must draw the same tokens"
    assert a != c, "another seed draws other tokens"


def case_stop_string(s: Server) -> None:
    text = _choice(s.complete(temperature=0, ignore_eos=True))["text"]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), f"no stop string to take from {text!r}"
    c = _choice(s.complete(temperature=0, ignore_eos=True, stop=[stop]))
    assert c["finish_reason"] == "stop"
    assert c["text"] == text[: text.index(stop)]


def case_min_tokens(s: Server) -> None:
    # The plain answer's first token made a stop token: min_tokens holds it back.
    c = _choice(
        s.complete(
            temperature=0, min_tokens=4, max_tokens=6, stop_token_ids=[s.plain[0]], return_token_ids=True
        )
    )
    assert len(c["token_ids"]) >= 4
    assert s.plain[0] not in c["token_ids"][:4]


def case_logit_bias(s: Server) -> None:
    favoured = s.plain[-1]
    c = _choice(
        s.complete(temperature=0, logit_bias={str(favoured): 100}, ignore_eos=True, return_token_ids=True)
    )
    assert c["token_ids"] == [favoured] * NEW


def case_penalties(s: Server) -> None:
    c = _choice(
        s.complete(
            temperature=0,
            presence_penalty=2.0,
            frequency_penalty=2.0,
            ignore_eos=True,
            return_token_ids=True,
            max_tokens=16,
        )
    )
    assert len(c["token_ids"]) == 16
    base = _choice(s.complete(temperature=0, ignore_eos=True, return_token_ids=True, max_tokens=16))[
        "token_ids"
    ]
    # Penalised greedy repeats no more than plain greedy does.
    assert len(set(c["token_ids"])) >= len(set(base))


def case_max_tokens_1(s: Server) -> None:
    c = _choice(s.complete(temperature=0, max_tokens=1, return_token_ids=True))
    assert c["token_ids"] == s.plain[:1] and c["finish_reason"] == "length"


def case_ignore_eos(s: Server) -> None:
    out = s.complete(temperature=0, ignore_eos=True, max_tokens=24)
    assert out["usage"]["completion_tokens"] == 24 and _choice(out)["finish_reason"] == "length"


def _chat(s: Server, **body) -> dict:
    """A chat answer with thinking off: V4.1's template then closes the reasoning in the prompt,
    so vLLM applies structured outputs from the first token (a raw completion prompt starts in
    reasoning under ``--reasoning-parser deepseek_v41``, where vLLM defers them to ``</think>``)."""
    messages = [{"role": "user", "content": "Describe the weather."}]
    return _maybe_refused(
        s.post(
            "/v1/chat/completions",
            {"messages": messages, "chat_template_kwargs": {"thinking": False}, **body},
        )
    )


def case_structured_choice(s: Server) -> None:
    out = _chat(
        s, temperature=1.0, seed=3, max_tokens=8, structured_outputs={"choice": ["sunny", "rainy", "cloudy"]}
    )
    assert out["choices"][0]["message"]["content"] in ("sunny", "rainy", "cloudy"), out["choices"][0]


def case_structured_regex(s: Server) -> None:
    import re

    out = _chat(s, temperature=1.0, seed=4, max_tokens=16, structured_outputs={"regex": "[a-c]{2}[0-9]{3}"})
    text = out["choices"][0]["message"]["content"]
    assert re.fullmatch("[a-c]{2}[0-9]{3}", text), text


def case_structured_json(s: Server) -> None:
    import json

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = _chat(
        s,
        temperature=1.0,
        seed=5,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    value = json.loads(out["choices"][0]["message"]["content"])
    assert set(value) == {"n"} and 0 <= value["n"] <= 9


def case_chat_logprobs(s: Server) -> None:
    out = _chat(s, max_tokens=NEW, temperature=0, logprobs=True, top_logprobs=2)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] > 0
    assert all(len(t["top_logprobs"]) == 2 for t in content)


def case_bad_logprobs_is_a_400(s: Server) -> None:
    r = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 10_000})
    assert r.status_code == 400 and "logprobs" in r.text, (r.status_code, r.text[:500])


def case_bad_n_is_a_400(s: Server) -> None:
    r = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 0})
    assert r.status_code == 400 and "n" in r.json()["error"]["message"], (r.status_code, r.text[:500])


CASES = {
    name[len("case_") :]: fn
    for name, fn in dict(globals()).items()
    if name.startswith("case_") and callable(fn)
}
