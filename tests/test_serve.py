"""`tandem serve` on loopback: the official `openai` client against it (whole answers and streams, errors,
concurrent requests, a client that goes away), its metrics, and the chat app on it as a remote engine. Every wait
has a deadline."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tandem.app.chat.heatmap import ExpertHeatmap
from tandem.app.chat.remote import RemoteBackend, RemoteServer, base_url, context_of
from tandem.app.chat.tui import TandemApp
from tandem.app.chat.widgets import ChatMessage, StatusBar
from tandem.app.cli.main import main
from tandem.app.serve.server import BackgroundServer, make_app
from tandem.app.serve.serving import EngineService
from tandem.runtime.loader import load_model
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.tokenizer import Tokenizer
from tests.test_tui import ask_and_wait, press, wait_for_screen, wait_until

CONTEXT = 96
DEFAULTS = SamplingParams(max_new_tokens=16)


@contextmanager
def serving(model: Path, api_key: str | None = None, batch: int = 4, step_delay: float = 0.0, **load: Any
            ) -> Iterator[tuple[EngineService, BackgroundServer]]:
    """The tiny model served on a free loopback port; `step_delay`: seconds each engine step takes at least (a
    slow model, so that a client can leave mid-answer); `load`: more settings of the load."""
    load.setdefault("context", CONTEXT)
    loaded = load_model(model, dtype="fp32", threads=1, batch=batch, **load)
    service = EngineService(loaded, "tiny", batch, 32)
    if step_delay:
        model_ = service.engine.model
        step = model_.forward_rows

        def slow(*a: Any, **k: Any) -> Any:
            time.sleep(step_delay)
            return step(*a, **k)

        model_.forward_rows = slow  # type: ignore[method-assign]
    service.start()
    try:
        with BackgroundServer(make_app(service, DEFAULTS, api_key)) as server:
            yield service, server
    finally:
        service.stop()


def client(server: BackgroundServer, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def alone(model: Path, messages: list[dict[str, str]] | None = None, prompt: str | None = None,
          max_new_tokens: int = 16) -> tuple[str, int, int]:
    """The request run alone through Engine.generate, greedy: its text, prompt tokens and new tokens."""
    loaded = load_model(model, dtype="fp32", context=CONTEXT, threads=1)
    tok = Tokenizer.from_model(model)
    ids = tok.encode_chat(messages) if messages is not None else tok.encode(prompt or "")
    tokens = list(loaded.engine.generate(ids, SamplingParams(max_new_tokens=max_new_tokens)))
    return tok.decode(tokens), len(ids), len(tokens)


def wait_for(condition: Any, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def metric(text: str, name: str) -> float:
    """One sample's value from Prometheus text (0 when it is absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


HELLO = [{"role": "user", "content": "Hello there"}]


def test_openai_client_whole_and_streamed_answers_are_the_request_run_alone(mixtral_dir: Path) -> None:
    text, n_prompt, n_new = alone(mixtral_dir, HELLO, max_new_tokens=10)
    story, story_prompt, story_new = alone(mixtral_dir, prompt="Once upon", max_new_tokens=12)
    with serving(mixtral_dir) as (_, server):
        c = client(server)
        whole = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10)  # type: ignore[arg-type]
        assert whole.choices[0].message.content == text
        assert whole.choices[0].finish_reason in ("stop", "length") and whole.object == "chat.completion"
        assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == \
            (n_prompt, n_new)
        chunks = list(c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10, stream=True,  # type: ignore[arg-type]
                                                stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == n_new
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
        done = c.completions.create(model="tiny", prompt="Once upon", max_tokens=12)
        assert done.choices[0].text == story and done.usage is not None
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (story_prompt, story_new)
        streamed = list(c.completions.create(model="tiny", prompt="Once upon", max_tokens=12, stream=True))
        assert "".join(ch.choices[0].text for ch in streamed) == story
        assert streamed[-1].usage is not None  # on the last chunk, asked for or not
        cut = story[len(story) // 2 :].strip()[:2]
        assert cut, f"the random model's answer is too short to cut: {story!r}"
        stopped = c.completions.create(model="tiny", prompt="Once upon", max_tokens=12, stop=[cut])
        assert stopped.choices[0].text == story[: story.index(cut)] and stopped.choices[0].finish_reason == "stop"
        pieces = list(c.completions.create(model="tiny", prompt="Once upon", max_tokens=12, stop=[cut], stream=True))
        assert "".join(ch.choices[0].text for ch in pieces) == story[: story.index(cut)]  # nothing past it streamed
        models = c.models.list().data
        assert [m.id for m in models] == ["tiny"] and models[0].model_extra["context_length"] == CONTEXT  # type: ignore[index]
        health = httpx.get(server.url.removesuffix("/v1") + "/health").json()
        assert health["status"] == "ok" and health["model"] == "tiny"


def test_a_next_turn_and_a_shared_system_prompt_reuse_the_cache(mixtral_dir: Path) -> None:
    """Prefix reuse: a prompt that begins as an earlier request's prefills only the rest (usage's cached_tokens,
    /metrics), and answers as it does alone."""
    first = "Once upon a time there was"
    with serving(mixtral_dir, batch=2) as (_, server):
        c = client(server)
        one = c.completions.create(model="tiny", prompt=first, max_tokens=8)
        assert one.usage is not None and one.usage.prompt_tokens_details is not None
        assert one.usage.prompt_tokens_details.cached_tokens == 0
        follow = first + one.choices[0].text + " and then"
        two = c.completions.create(model="tiny", prompt=follow, max_tokens=8)
        assert two.usage is not None and two.usage.prompt_tokens_details is not None
        assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - 1
        system = {"role": "system", "content": "You answer questions about the sea, briefly and kindly."}
        asks = [[system, {"role": "user", "content": q}] for q in ("Why is it salty?", "How deep is it?")]
        answers = [c.chat.completions.create(model="tiny", messages=m, max_tokens=6) for m in asks]  # type: ignore[arg-type]
        cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers if a.usage and
                  a.usage.prompt_tokens_details]
        assert len(cached) == 2 and cached[1] >= 8  # (the system prompt, at least)
        text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
        assert metric(text, "tandem_prompt_tokens_cached_total") == two.usage.prompt_tokens_details.cached_tokens \
            + sum(cached)
    assert two.choices[0].text == alone(mixtral_dir, prompt=follow, max_new_tokens=8)[0]
    assert answers[1].choices[0].message.content == alone(mixtral_dir, asks[1], max_new_tokens=6)[0]


def test_errors_come_in_openais_shape_with_the_right_status(mixtral_dir: Path) -> None:
    with serving(mixtral_dir, api_key="sesame") as (_, server):
        c = client(server, "sesame")
        with pytest.raises(openai.BadRequestError) as bad:
            c.chat.completions.create(model="tiny", messages=HELLO, temperature=-1)  # type: ignore[arg-type]
        assert "temperature" in bad.value.message
        with pytest.raises(openai.BadRequestError) as many:
            c.chat.completions.create(model="tiny", messages=HELLO, n=2)  # type: ignore[arg-type]
        assert "more than one choice" in many.value.message
        with pytest.raises(openai.BadRequestError) as long:
            c.completions.create(model="tiny", prompt="word " * 200)
        assert long.value.code == "context_length_exceeded" and f"holds {CONTEXT}" in long.value.message
        with pytest.raises(openai.NotFoundError) as missing:
            c.chat.completions.create(model="gpt-4o", messages=HELLO)  # type: ignore[arg-type]
        assert missing.value.code == "model_not_found" and "tiny" in missing.value.message
        with pytest.raises(openai.AuthenticationError) as key:
            client(server, "wrong").models.list()
        assert key.value.code == "invalid_api_key"
        root = server.url.removesuffix("/v1")
        assert httpx.get(root + "/metrics").status_code == 401
        assert httpx.get(root + "/health").status_code == 200  # (open: a load balancer's probe has no key)
        auth = {"Authorization": "Bearer sesame"}
        for response in (httpx.post(server.url + "/chat/completions", content=b"{oops", headers=auth),
                         httpx.get(server.url + "/nowhere", headers=auth),
                         httpx.get(server.url + "/chat/completions", headers=auth),
                         httpx.post(server.url + "/chat/completions/", json={"messages": HELLO}, headers=auth)):
            assert response.status_code in (400, 404, 405)  # (a slash too many: 404, not a redirect)
            error = response.json()["error"]
            assert error["message"] and error["type"]
        assert c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).usage is not None  # type: ignore[arg-type]


def test_concurrent_requests_queue_batch_and_each_gets_its_own_answer(mixtral_dir: Path) -> None:
    asks = [[{"role": "user", "content": f"Question number {i}"}] for i in range(5)]
    wanted = [alone(mixtral_dir, m, max_new_tokens=8)[0] for m in asks]
    with serving(mixtral_dir, batch=2) as (service, server):
        c = client(server)
        with ThreadPoolExecutor(5) as pool:
            got = list(pool.map(lambda m: c.chat.completions.create(model="tiny", messages=m, max_tokens=8)  # type: ignore[arg-type]
                                .choices[0].message.content, asks))
        assert got == wanted
        assert service.engine.stats.busiest == 2  # two at a time, the rest waited
        text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
        assert metric(text, 'tandem_requests_total{endpoint="chat",outcome="ok"}') == 5
        assert metric(text, "tandem_time_to_first_token_seconds_count") == 5
        assert metric(text, "tandem_generation_tokens_total") == service.engine.stats.new_tokens
        assert metric(text, 'tandem_experts_run_total{tier="cpu"}') > 0
        assert metric(text, "tandem_queue_depth") == 0 and metric(text, "tandem_generation_tokens_per_second") > 0


def test_metrics_on_the_accelerator_tier_report_the_expert_cache(mixtral_dir: Path) -> None:
    with serving(mixtral_dir, context=40, accelerator="emulated", vram_gb=0.002) as (service, server):  # 8 slots
        assert service.loaded.model.dispatcher.cache.slots > 0
        c = client(server)
        for prompt in ("Once upon", "A long time ago", "Once upon"):
            c.completions.create(model="tiny", prompt=prompt, max_tokens=6)
        text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
        gpu, cpu = (metric(text, f'tandem_experts_run_total{{tier="{t}"}}') for t in ("gpu", "cpu"))
        assert gpu > 0 and cpu > 0
        stats = service.loaded.model.dispatcher.request_stats()
        assert "tandem_expert_cache_hit_rate" in text
        assert metric(text, "tandem_expert_cache_hit_rate") == pytest.approx(stats.hit_rate, abs=1e-6)


def test_a_client_that_goes_away_stops_its_generation(mixtral_dir: Path) -> None:
    with serving(mixtral_dir, step_delay=0.05) as (service, server):
        stats = service.engine.stats
        with httpx.Client(timeout=30) as h, h.stream("POST", server.url + "/completions", json={
                "model": "tiny", "prompt": "Once upon", "max_tokens": 80, "stream": True}) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data:")
                if seen == 3:
                    break  # leaves mid-answer: the connection closes
        wait_for(lambda: service.running == 0)
        assert stats.new_tokens < 20, "the answer went on after its client left"
        before = stats.new_tokens
        with pytest.raises(httpx.ReadTimeout):  # a whole answer that the client stops waiting for
            httpx.post(server.url + "/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 80},
                       timeout=0.4)
        wait_for(lambda: service.running == 0)
        assert stats.new_tokens - before < 30
        text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
        assert metric(text, 'tandem_requests_total{endpoint="completions",outcome="cancelled"}') == 2
        # and the server goes on answering
        assert client(server).completions.create(model="tiny", prompt="Once", max_tokens=3).usage is not None


def test_serve_refuses_an_outside_address_without_a_key_and_a_port_in_use(
        mixtral_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert main(["serve", "--model", str(mixtral_dir), "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    with serving(mixtral_dir) as (_, server):
        assert main(["serve", "--model", str(mixtral_dir), "--port", str(server.port)]) == 2
        assert "choose another --port" in capsys.readouterr().err


def test_remote_urls_and_context_lengths_are_read_as_servers_give_them() -> None:
    assert base_url("http://127.0.0.1:8080") == "http://127.0.0.1:8080/v1"
    assert base_url("http://gpu-box:11434/v1/") == "http://gpu-box:11434/v1"
    assert base_url("https://h/api/openai/v1") == "https://h/api/openai/v1"
    with pytest.raises(Exception, match="not an http"):
        base_url("gpu-box:8000")
    assert context_of({"id": "a", "context_length": 4096}) == 4096
    assert context_of({"id": "a", "max_model_len": 32768}) == 32768  # vLLM
    assert context_of({"id": "a", "meta": {"n_ctx_train": 8192}}) == 8192  # llama-server
    assert context_of({"id": "a"}) == 0  # Ollama: not said


def test_remote_chat_errors_say_what_to_do(mixtral_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "--remote", "http://127.0.0.1:9/v1"]) == 2
    assert "is the server running" in capsys.readouterr().err
    with serving(mixtral_dir, api_key="sesame") as (_, server):
        assert main(["chat", "--remote", server.url, "--api-key", "wrong"]) == 2
        assert "--api-key" in capsys.readouterr().err
        assert main(["chat", "--remote", server.url, "--api-key", "sesame", "--remote-model", "other"]) == 2
        assert "serves tiny" in capsys.readouterr().err


async def test_the_chat_app_on_a_tandem_server(mixtral_dir: Path) -> None:
    with serving(mixtral_dir) as (_, server):
        remote = RemoteServer(server.url)
        app = TandemApp(lambda name: RemoteBackend(remote, name), remote=remote,
                        params=SamplingParams(max_new_tokens=8))
        async with app.run_test(size=(120, 30)) as pilot:
            await ask_and_wait(pilot, app, "Hello there")
            sent = app.chat.current.messages(app.chat.chat_settings(app.chat.current).system_prompt)[:-1]
            direct = client(server).chat.completions.create(model="tiny", messages=sent, max_tokens=8)  # type: ignore[arg-type]
            answers = [m for m in app.query(ChatMessage) if m.role == "assistant"]
            assert answers[-1].text == direct.choices[0].message.content
            backend = app.lifecycle.backend
            assert backend is not None and backend.remote == server.url and backend.context == CONTEXT
            for name in ("name", "family", "placement"):
                assert isinstance(getattr(backend, name), str)
            assert backend.where() is None and backend.vram() is None and backend.loaded_model() is None
            status = str(app.query_one(StatusBar).render())
            assert f"remote: 127.0.0.1:{server.port}" in status and "tiny" in status and "tok/s" in status
            assert app.chat.current.turns[-1].content == direct.choices[0].message.content  # saved like any chat
            await press(pilot, "f5")  # the heatmap says why it has nothing
            assert "runs on" in app.query_one(ExpertHeatmap).text
            await press(pilot, "ctrl+t")
            assert any("runs on" in n.message for n in app._notifications)
            await press(pilot, "ctrl+o")  # the picker lists the server's models
            from tandem.app.chat.screens.picker import PickerScreen

            picker = await wait_for_screen(pilot, app, PickerScreen)
            await wait_until(pilot, lambda: picker.entries is not None)
            assert [e.name for e in picker.entries] == ["tiny"]
            await press(pilot, "escape")
        remote.close()


def test_request_queue_feeds_a_running_batch(mixtral_dir: Path) -> None:
    """Requests put while the engine runs join it; a request stopped before it joined leaves at once; closing the
    queue ends the run."""
    from tandem.runtime.batch import BatchEngine, BatchRequest, DoneEvent, RequestQueue

    loaded = load_model(mixtral_dir, dtype="fp32", context=CONTEXT, threads=1)
    engine = BatchEngine(loaded.model, loaded.engine.eos_ids, 2)
    queue = RequestQueue()
    done: dict[str, str] = {}

    def run() -> None:
        for event in engine.run(queue):
            if isinstance(event, DoneEvent):
                done[event.result.key] = str(event.result.finish_reason)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    queue.put(BatchRequest("a", [5, 6, 7], SamplingParams(max_new_tokens=4)))
    wait_for(lambda: "a" in done)
    engine.finish("b")
    queue.put(BatchRequest("b", [5, 6], SamplingParams(max_new_tokens=4)))
    queue.put(BatchRequest("c", [8], SamplingParams(max_new_tokens=3)))
    wait_for(lambda: "c" in done)
    assert done["b"] == "stop" and done["a"] in ("length", "eos")
    assert thread.is_alive()  # waiting for more
    queue.close()
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(Exception, match="stopped taking"):
        queue.put(BatchRequest("d", [1]))
    assert json.dumps(done)  # (plain data)


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_tandem_serve_runs_until_stopped(mixtral_dir: Path, tmp_path: Path, stop: str) -> None:
    """The command itself: it says where it listens, answers, and stops cleanly on Ctrl+C (SIGINT) or a service
    manager's SIGTERM."""
    import os
    import re
    import signal
    import subprocess
    import sys

    log = tmp_path / "serve.log"
    with log.open("w") as err:
        # Ctrl+C as from a terminal: a run started in the background (a CI job's, say) inherits SIGINT ignored,
        # and Python then leaves it ignored
        start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "sys.argv[0] = 'tandem'; runpy.run_module('tandem.app.cli.main', run_name='__main__')")
        proc = subprocess.Popen([sys.executable, "-c", start, "serve", "--model", str(mixtral_dir), "--port", "0",
                                 "--dtype", "fp32", "--threads", "1", "--context", "64", "--no-profile"],
                                stderr=err, env=os.environ | {"TANDEM_API_KEY": ""})
    try:
        wait_for(lambda: "serving" in log.read_text() or proc.poll() is not None, timeout=120)
        found = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", log.read_text())
        assert found, log.read_text()
        answer = openai.OpenAI(base_url=found.group(1), api_key="x", max_retries=0, timeout=60).completions.create(
            model=mixtral_dir.name, prompt="Once upon", max_tokens=5)
        assert answer.usage is not None and answer.usage.completion_tokens == 5
    finally:
        proc.send_signal(getattr(signal, stop))
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # (never left behind: the test fails on the timeout)
            raise
    assert code == 0, log.read_text()
    assert "stopping" in log.read_text() and "Traceback" not in log.read_text()


@pytest.mark.parametrize("concurrency", [1, 2])
def test_bench_serve_reports_its_figures(mixtral_dir: Path, tmp_path: Path, concurrency: int) -> None:
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--model", str(mixtral_dir), "--requests", "3", "--concurrency",
                 str(concurrency), "--in", "6", "--out", "5", "--dtype", "fp32", "--threads", "1", "--no-profile",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["requests"] == 3 and r["concurrency"] == concurrency and r["batch"] == concurrency
    assert r["tokens_per_s"] > 0 and r["requests_per_s"] > 0 and r["ttft_ms"]["p50"] > 0
    assert r["generate"]["decode_tok_s"] > 0 and r["serve_vs_generate"] > 0
    assert r["generate"]["runs"] == (3 if concurrency == 1 else 6)


async def test_tokens_reach_the_event_loop_in_order_with_few_wakes() -> None:
    """The engine's thread wakes the loop for the first token and the end at once, and for the tokens between at most
    every STREAM_INTERVAL_S: every event arrives, in order, with fewer wakes than tokens."""
    import asyncio

    from tandem.app.serve import serving
    from tandem.runtime.batch import BatchResult, DoneEvent, TokenEvent

    sub = serving.Subscription("k", asyncio.get_running_loop())
    wakes: list[int] = []
    receive = sub._receive
    sub._receive = lambda events: (wakes.append(len(events)), receive(events))  # type: ignore[method-assign]

    def engine() -> None:
        for i in range(40):
            sub.deliver(TokenEvent("k", i))
            time.sleep(0.002)
        sub.deliver(DoneEvent(BatchResult("k", list(range(40)), 3, "length")))

    thread = threading.Thread(target=engine)
    thread.start()
    got = []
    while not got or not isinstance(got[-1], DoneEvent):
        got.append(await asyncio.wait_for(sub.events.get(), 10))
    thread.join()
    assert [e.token for e in got[:-1]] == list(range(40))
    assert wakes[0] == 1 and sum(wakes) == 41  # the first token alone, then batches, the end with what was held
    assert len(wakes) < 20  # 40 tokens 2 ms apart: about one wake in 20 ms, not one a token


FAKE_LLAMA_SERVER = '''#!{python}
"""Stands in for llama-server: /health, and /v1/completions streaming one chunk a token 5 ms apart."""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["ignore_eos"] and body["stream"]
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        for i in range(body["max_tokens"]):
            self.wfile.write(b'data: {{"choices": [{{"text": "x", "finish_reason": null}}]}}\\n\\n'); self.wfile.flush()
            time.sleep(0.005)
        self.wfile.write(b'data: {{"choices": [{{"text": "", "finish_reason": "length"}}]}}\\n\\ndata: [DONE]\\n\\n')

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''

FAKE_LLAMA_BENCH = '''#!{python}
import json, sys
assert "-d" in sys.argv
print(json.dumps([{{"n_prompt": 0, "n_gen": int(sys.argv[sys.argv.index("-n") + 1]), "avg_ts": 250.0}}]))
'''


def test_bench_serve_measures_llama_server_the_same_way(mixtral_dir: Path, tmp_path: Path) -> None:
    """--peer llama.cpp: a stand-in llama-server streaming a token every 5 ms (200 tok/s) against a stand-in
    llama-bench saying 250 tok/s: the ratio is about 0.8. Without a GGUF model or the binaries: an error that says
    what to give."""
    from tests.ggufs import write_gguf

    fakes = []
    for name, text in (("llama-server", FAKE_LLAMA_SERVER), ("llama-bench", FAKE_LLAMA_BENCH)):
        fake = tmp_path / name
        fake.write_text(text.format(python=sys.executable))
        fake.chmod(0o755)
        fakes.append(fake)
    gguf = tmp_path / "m.gguf"
    write_gguf(mixtral_dir, gguf, "F32")
    out = tmp_path / "serve.json"
    args = ["bench", "serve", "--model", str(gguf), "--requests", "3", "--in", "6", "--out", "12", "--dtype", "fp32",
            "--threads", "1", "--no-profile", "--peer", "llama.cpp", "--llama-server", str(fakes[0]),
            "--llama-bench", str(fakes[1])]
    assert main([*args, "--json", str(out)]) == 0
    peer = json.loads(out.read_text())["peer"]
    assert peer["name"] == "llama.cpp" and peer["rounds"] == 3 and peer["bench_tg_tok_s"] == 250.0
    # (about 200: tokens that arrive together after a delay make the measured rate a little higher, 201.8 once)
    assert 100 < peer["server_decode_tok_s"] < 220 and peer["serve_vs_generate"] == pytest.approx(
        peer["server_decode_tok_s"] / 250.0, rel=0.2)
    assert main(args[:-2]) == 2  # no llama-bench
    assert main(["bench", "serve", "--model", str(mixtral_dir), "--peer", "llama.cpp", "--llama-server",
                 str(fakes[0]), "--llama-bench", str(fakes[1])]) == 2  # a folder: llama.cpp cannot serve it


FAKE_CACHING_LLAMA_SERVER = '''#!{python}
"""Stands in for llama-server with its prompt cache: /health, and /v1/completions streaming "ok " a token, its last
chunk's timings counting a character a token, those the previous prompt shared cached."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
seen = [""]

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        cached = len(os.path.commonprefix([seen[0], prompt]))
        seen[0] = prompt
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        for i in range(body["max_tokens"]):
            self.wfile.write(b'data: {{"choices": [{{"text": "ok ", "finish_reason": null}}]}}\\n\\n')
            self.wfile.flush()
        last = {{"choices": [{{"text": "", "finish_reason": "length"}}],
                "timings": {{"prompt_n": len(prompt) - cached, "cache_n": cached, "predicted_n": body["max_tokens"]}}}}
        self.wfile.write(b"data: " + json.dumps(last).encode() + b"\\n\\ndata: [DONE]\\n\\n")

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_bench_chat_turns_reports_reuse_turn_by_turn_beside_llama_server(mixtral_dir: Path, tmp_path: Path) -> None:
    """`bench chat --turns`: each turn's prompt is the history, so from the second on most of it is cached, for
    Tandem (usage) and for llama-server (its timings: a stand-in here); without a GGUF file --peer is refused."""
    from tests.ggufs import write_gguf

    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_CACHING_LLAMA_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    write_gguf(mixtral_dir, gguf, "F32")
    out = tmp_path / "turns.json"
    args = ["bench", "chat", "--model", str(gguf), "--turns", "3", "--words", "6", "--new-tokens", "4",
            "--dtype", "fp32", "--threads", "1", "--no-profile", "--peer", "llama.cpp", "--llama-server", str(fake)]
    assert main([*args, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    ours, theirs = r["tandem"], r["peer"]["turns"]
    assert [t["turn"] for t in ours] == [1, 2, 3] and ours[0]["cached_tokens"] == 0
    for before, now in zip(ours, ours[1:], strict=False):  # the earlier turn's prompt, at least, is reused
        assert now["prompt_tokens"] > before["prompt_tokens"] and now["cached_tokens"] >= before["prompt_tokens"] - 1
    assert all(t["ttft_s"] is not None and t["new_tokens"] == 4 for t in ours) and len(r["ttft_vs_new_alone"]) == 3
    assert theirs[0]["cached_tokens"] == 0 and theirs[2]["cached_tokens"] > theirs[1]["cached_tokens"] > 0
    assert len(r["ttft_vs_peer"]) == 3  # (each a ratio of two times: no figure is asserted, whatever the CPU)
    assert main(["bench", "chat", "--model", str(mixtral_dir), "--turns", "2", "--peer", "llama.cpp",
                 "--llama-server", str(fake)]) == 2  # a folder: llama.cpp cannot serve it
