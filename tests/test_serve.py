"""``kq serve`` through the OpenAI client: a server started here on 127.0.0.1 (its own process, stopped by the test
and by ``--stop-after`` at the latest), serving the shipped 4-bit model at a quarter of its experts under rule
exact: every answer is the unmodified model's greedy text, alone or beside another request, and a bad request,
another model, a context overflow or a client gone mid-stream leaves the next request's answer as it was.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "models" / "wheels-moe"
PROMPTS = ("def read_config(path):", "class Parser:")
TOKENS = 12


@pytest.fixture(scope="module")
def server():
    command = [sys.executable, "-m", "kq", "serve", "--model", str(WHEELS), "--residency", "0.25", "--port", "0",
               "--context", "256", "--stop-after", "600"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = []
    reader = threading.Thread(target=lambda: first.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout=180)
    try:
        assert first and "http://127.0.0.1:" in first[0], (first, process.poll())
        url = first[0].split(" at ")[1].split("/v1")[0]
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 0, process.stderr.read()[-2000:]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key="unused", timeout=120, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def expected():
    """The unmodified model's greedy text for each prompt, as mlx_lm.generate gives it."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(WHEELS))
    return {prompt: generate(model, tokenizer, prompt, max_tokens=TOKENS) for prompt in PROMPTS}


def complete(client, prompt: str, **kwargs) -> str:
    response = client.completions.create(model="wheels-moe", prompt=prompt, max_tokens=TOKENS, temperature=0,
                                         **kwargs)
    return response.choices[0].text


def test_completions_give_the_unmodified_models_text(client, expected):
    for prompt in PROMPTS:
        assert complete(client, prompt) == expected[prompt]


def test_a_streamed_completion_gives_the_same_text(client, expected):
    chunks = client.completions.create(model="wheels-moe", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected[PROMPTS[0]]


def test_chat_completions_streamed_and_not_agree(client):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    whole = client.chat.completions.create(model="wheels-moe", messages=messages, max_tokens=TOKENS, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens == TOKENS
    chunks = client.chat.completions.create(model="wheels-moe", messages=messages, max_tokens=TOKENS, temperature=0,
                                            stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text


def test_concurrent_requests_each_get_their_text_alone(client, expected):
    results = {}
    threads = [threading.Thread(target=lambda p=prompt: results.__setitem__(p, complete(client, p)))
               for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert results == expected


def test_the_model_list_names_the_served_model(client):
    assert [model.id for model in client.models.list()] == ["wheels-moe"]


def test_another_model_and_a_context_overflow_are_json_errors(client, expected):
    with pytest.raises(openai.APIStatusError) as another:
        client.completions.create(model="other-model", prompt="x", max_tokens=4)
    assert "is not served here" in json.dumps(another.value.body)
    with pytest.raises(openai.APIStatusError) as overflow:
        client.completions.create(model="wheels-moe", prompt="x " * 100, max_tokens=200)
    assert "context" in json.dumps(overflow.value.body)
    assert complete(client, PROMPTS[0]) == expected[PROMPTS[0]]


def test_malformed_requests_get_json_errors(server, client, expected):
    address = urlparse(server)
    for body, status in ((b"{not json", 400), (b"[1, 2]", 400), (json.dumps({"prompt": "x", "max_tokens": -3}).encode(),
                                                                  400)):
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == status
        assert "error" in json.loads(response.read())
        connection.close()
    assert complete(client, PROMPTS[1]) == expected[PROMPTS[1]]


def test_a_client_gone_mid_stream_leaves_the_next_answer_as_it_was(server, client, expected):
    address = urlparse(server)
    body = json.dumps({"model": "wheels-moe", "prompt": PROMPTS[1], "max_tokens": 64, "temperature": 0,
                       "stream": True}).encode()
    with socket.create_connection((address.hostname, address.port), timeout=60) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert raw.recv(64).startswith(b"HTTP/1.")
    assert complete(client, PROMPTS[0]) == expected[PROMPTS[0]]
