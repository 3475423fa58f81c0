"""The official openai SDK through compactor vs direct, against a mock upstream.

Whatever compactor does inside, a client must see exactly what it would see
without it: the same parsed objects, the same bytes, the same errors.
"""

from __future__ import annotations

import openai
import pytest

from conftest import API_KEY, Compactor, openai_client
from mock_upstream import COMPLETION, STREAM_PIECES, MockUpstream, stream_events

MESSAGES = [
    {"role": "system", "content": "You are a test."},
    {"role": "user", "content": "Say hello."},
]

# Headers that legitimately differ between two responses or hops.
VOLATILE_HEADERS = {"date", "connection", "keep-alive", "transfer-encoding"}


def comparable_headers(headers) -> list[tuple[str, str]]:
    return sorted(
        (k.lower(), v)
        for k, v in headers.multi_items()
        if k.lower() not in VOLATILE_HEADERS and not k.lower().startswith("x-compactor-")
    )


def both(mock: MockUpstream, via: Compactor) -> tuple[openai.OpenAI, openai.OpenAI]:
    return openai_client(mock.url), via.client()


def test_non_streaming_parsed_result_identical(mock_upstream, mock_via_compactor):
    direct, proxied = both(mock_upstream, mock_via_compactor)
    a = direct.chat.completions.create(model="mock-model", messages=MESSAGES)
    b = proxied.chat.completions.create(model="mock-model", messages=MESSAGES)
    assert b.model_dump() == a.model_dump()
    assert b.choices[0].message.content == COMPLETION["choices"][0]["message"]["content"]
    assert b.usage is not None and b.usage.prompt_tokens == 17


def test_non_streaming_raw_bytes_and_headers_identical(mock_upstream, mock_via_compactor):
    direct, proxied = both(mock_upstream, mock_via_compactor)
    a = direct.chat.completions.with_raw_response.create(model="mock-model", messages=MESSAGES)
    b = proxied.chat.completions.with_raw_response.create(model="mock-model", messages=MESSAGES)
    assert b.status_code == a.status_code == 200
    assert b.content == a.content
    assert comparable_headers(b.headers) == comparable_headers(a.headers)
    assert b.headers.get_list("x-mock-multi") == ["one", "two"]


def test_request_reaches_upstream_intact(mock_upstream, mock_via_compactor):
    proxied = mock_via_compactor.client()
    proxied.chat.completions.create(
        model="mock-model",
        messages=MESSAGES,
        temperature=0.5,
        extra_body={"x_unknown": {"k": [1]}},
        extra_headers={"x-session-id": "sess-42", "x-custom": "kept"},
    )
    (seen,) = mock_upstream.chat_requests()
    body = seen.json()
    assert body["messages"] == MESSAGES
    assert body["temperature"] == 0.5
    assert body["x_unknown"] == {"k": [1]}
    headers = {k.lower(): v for k, v in seen.headers}
    assert headers["authorization"] == f"Bearer {API_KEY}"
    assert headers["host"] == mock_upstream.url.removeprefix("http://")
    assert headers["x-session-id"] == "sess-42"
    assert headers["x-custom"] == "kept"
    assert headers["user-agent"].startswith("OpenAI/Python")


@pytest.mark.parametrize("include_usage", [False, True])
def test_streaming_parsed_chunks_identical(mock_upstream, mock_via_compactor, include_usage):
    direct, proxied = both(mock_upstream, mock_via_compactor)
    kw = {"stream_options": {"include_usage": True}} if include_usage else {}
    a = [c.model_dump() for c in direct.chat.completions.create(
        model="mock-model", messages=MESSAGES, stream=True, **kw)]
    b = [c.model_dump() for c in proxied.chat.completions.create(
        model="mock-model", messages=MESSAGES, stream=True, **kw)]
    assert b == a
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in b if c["choices"])
    assert text == "".join(STREAM_PIECES)
    usage_chunks = [c for c in b if not c["choices"]]
    assert len(usage_chunks) == (1 if include_usage else 0)


@pytest.mark.parametrize("include_usage", [False, True])
def test_streaming_raw_bytes_identical(mock_upstream, mock_via_compactor, include_usage):
    direct, proxied = both(mock_upstream, mock_via_compactor)
    kw = {"stream_options": {"include_usage": True}} if include_usage else {}
    raw = []
    for client in (direct, proxied):
        with client.chat.completions.with_streaming_response.create(
            model="mock-model", messages=MESSAGES, stream=True, **kw
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw.append((b"".join(r.iter_bytes()), comparable_headers(r.headers)))
    (a, ha), (b, hb) = raw
    assert b == a == b"".join(stream_events(include_usage))
    assert hb == ha


def test_first_event_arrives_while_upstream_still_generating(mock_upstream, mock_via_compactor):
    """The mock holds the stream after its first content event until we release
    it: a proxy that buffered would deliver nothing until the mock's safety
    timeout, which the mock records."""
    stream = iter(mock_via_compactor.client().chat.completions.create(
        model="mock-gated", messages=MESSAGES, stream=True
    ))
    first = next(stream)
    assert first.choices[0].delta.role == "assistant"
    second = next(stream)
    assert second.choices[0].delta.content == STREAM_PIECES[0]
    assert not mock_upstream.gate_timed_out, "first events only arrived after the upstream gave up waiting"
    mock_upstream.release()
    rest = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in rest if c.choices) == "".join(STREAM_PIECES[1:])
    assert not mock_upstream.gate_timed_out


@pytest.mark.parametrize(
    "status, exc",
    [
        (400, openai.BadRequestError),
        (401, openai.AuthenticationError),
        (404, openai.NotFoundError),
        (429, openai.RateLimitError),
        (500, openai.InternalServerError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_error_statuses_and_bodies_identical(mock_upstream, mock_via_compactor, status, exc, stream):
    direct, proxied = both(mock_upstream, mock_via_compactor)
    errors = []
    for client in (direct, proxied):
        with pytest.raises(exc) as info:
            client.chat.completions.create(model=f"mock-error-{status}", messages=MESSAGES, stream=stream)
        errors.append(info.value)
    a, b = errors
    assert b.status_code == a.status_code == status
    assert b.response.content == a.response.content
    assert b.body == a.body
    assert b.message == a.message
    assert comparable_headers(b.response.headers) == comparable_headers(a.response.headers)


def test_other_endpoints_pass_through(mock_upstream, mock_via_compactor):
    direct, proxied = both(mock_upstream, mock_via_compactor)
    a = direct.models.with_raw_response.list()
    b = proxied.models.with_raw_response.list()
    assert b.content == a.content
    assert [m.id for m in b.parse()] == ["mock-model"]
