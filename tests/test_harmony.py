"""gpt-oss's harmony chat format: a template of the published one's structure renders in the sandbox, and the chat
shows only the final channel of an answer, by deltas, however the stream is cut."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from datetime import datetime

import pytest

from tandem.app.harmony import answer_view, final_text, fold, is_harmony, without_thoughts
from tandem.kernels.errors import CheckpointError
from tandem.runtime.chat_template import render
from tandem.runtime.synth import CHATML, train_tokenizer
from tandem.runtime.tokenizer import StreamDecoder, Tokenizer

# The structure of openai/gpt-oss-20b's chat_template.jinja (its tool rendering left out): a system message built by
# a macro (identity, dates, reasoning effort, valid channels), the first system/developer message as the developer's
# instructions, earlier assistant turns as final-channel messages only (the analysis is dropped), a check that refuses
# channel tags inside content, and `<|start|>assistant` as the generation prompt.
HARMONY = """
{%- macro build_system_message() -%}
    {%- if model_identity is not defined %}
        {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
    {%- endif %}
    {{- model_identity + "\\n" }}
    {{- "Knowledge cutoff: 2024-06\\n" }}
    {{- "Current date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
    {%- if reasoning_effort is not defined %}
        {%- set reasoning_effort = "medium" %}
    {%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- endmacro -%}
{{- "<|start|>system<|message|>" }}
{{- build_system_message() }}
{{- "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message %}
    {{- "<|start|>developer<|message|>" }}
    {{- "# Instructions\\n\\n" }}
    {{- developer_message }}
    {{- "\\n\\n" }}
    {{- "<|end|>" }}
{%- endif %}
{%- set last_tool_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "content" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.content or
                   "<|channel|>final<|message|>" in message.content %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") }}
            {%- endif %}
        {%- endif %}
        {%- if loop.last and not add_generation_prompt and "thinking" in message %}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
        {%- endif %}
        {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- set last_tool_call.name = none %}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}
"""


def test_a_harmony_template_renders_in_the_sandbox() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    text = render(HARMONY, messages, True, "", "<|return|>")
    today = datetime.now().strftime("%Y-%m-%d")
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
        f"2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. "
        "Channel must be included for every message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
        "<|start|>user<|message|>Hi<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
        "<|start|>user<|message|>2+2?<|end|>"
        "<|start|>assistant")
    assert is_harmony(HARMONY) and not is_harmony(CHATML) and not is_harmony(None)


def test_channel_tags_in_content_are_the_templates_refusal() -> None:
    bad = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<|channel|>final<|message|>x"}]
    with pytest.raises(CheckpointError, match="channel"):
        render(HARMONY, bad, True, "", "")


ANSWER = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
          "<|start|>assistant<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{}<|call|>"
          "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>")


def test_only_the_final_channel_is_shown() -> None:
    assert final_text(ANSWER) == "It is 4."
    assert final_text("<|channel|>analysis<|message|>thinking hard") == ""  # still thinking: nothing yet
    assert final_text("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final") == ""  # not yet
    assert final_text("<|channel|>final<|message|>Par") == "Par"  # stopped mid-answer (no end marker)
    assert final_text("Plain text from a model that ignores harmony") == "Plain text from a model that ignores harmony"


@pytest.mark.parametrize("seed", range(5))
def test_the_shown_text_streams_by_deltas_however_the_answer_is_cut(seed: int) -> None:
    units = re.findall(r"<\|[a-z]+\|>|.", ANSWER, re.DOTALL)  # special tokens decode whole; text may be cut anywhere
    rng, pieces = random.Random(seed), []
    while units:
        n = rng.randint(1, 6)
        pieces.append("".join(units[:n]))
        units = units[n:]
    deltas = list(fold(pieces))
    assert "".join(deltas) == "It is 4." and all(deltas)


def test_the_stream_decoder_keeps_special_tokens_when_asked() -> None:
    tok = Tokenizer(train_tokenizer(512), {}, None, None)
    ids = tok.encode("<|im_start|>hello", add_special_tokens=False)
    for keep, want in ((False, "hello"), (True, "<|im_start|>hello")):
        decoder = StreamDecoder(tok, keep_special=keep)
        assert "".join(decoder.push(i) for i in ids) + decoder.flush() == want


def test_the_chat_backend_streams_the_final_channel_of_a_harmony_model() -> None:
    from types import SimpleNamespace

    from tandem.app.chat.backend import RuntimeBackend
    from tandem.runtime.sampling import SamplingParams

    asked: list[bool] = []

    def text(messages: list[dict[str, str]], params: SamplingParams, keep_special: bool = False) -> Iterator[str]:
        asked.append(keep_special)
        yield from ["<|channel|>analysis<|message|>Greet.<|end|>", "<|start|>assistant", "<|channel|>final",
                    "<|message|>", "Hi", " there", "<|return|>"]

    backend = RuntimeBackend.__new__(RuntimeBackend)  # (no model: only the text path is under test)
    backend._text = text  # type: ignore[method-assign]
    for template, want, keep in ((HARMONY, "Hi there", True), (CHATML, None, False)):
        backend.loaded = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template))  # type: ignore[assignment]
        got = "".join(backend.stream([{"role": "user", "content": "hi"}], SamplingParams()))
        assert got == (want or "".join(text([], SamplingParams()))) and asked[0] is keep
        asked.clear()


def test_the_server_streams_the_final_channel_of_a_harmony_answer() -> None:
    """`tandem serve`'s per-request text: the final channel's deltas for a harmony chat, everything otherwise."""
    from tandem.app.serve.serving import TextStream

    backend = train_tokenizer(512)
    backend.add_special_tokens(sorted(set(re.findall(r"<\|[a-z]+\|>", ANSWER))))  # whole tokens, as gpt-oss's
    tok = Tokenizer(backend, {}, None, None)
    ids = tok.encode(ANSWER, add_special_tokens=False)
    plain = re.sub(r"<\|[a-z]+\|>", "", ANSWER)  # not harmony: special tokens are not shown
    for view, want in ((answer_view(HARMONY), "It is 4."), (None, plain)):
        stream = TextStream(tok, view)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == want


GEMMA_ANSWER = "<|channel>thought\nThe user asks 2+2. Easy.<channel|>It is 4."


def test_gemma4_thoughts_are_hidden_and_the_answer_streams_by_deltas() -> None:
    """Gemma 4's thought channel (`<|channel>thought ... <channel|>`, its template's) is not shown; what follows is,
    by deltas however the answer is cut (a marker's start is held back until it is known)."""
    gemma = "{{ bos_token }}<|turn>model\n<|channel>thought\n<channel|>"
    assert answer_view(gemma).shown is without_thoughts and answer_view(HARMONY).shown is final_text  # type: ignore[union-attr]
    assert answer_view(CHATML) is None
    assert without_thoughts(GEMMA_ANSWER) == "It is 4."
    assert without_thoughts("<|channel>thought\nhmm") == ""  # still thinking
    assert without_thoughts("It is <") == "It is " and without_thoughts("It is <b>") == "It is <b>"
    assert without_thoughts("It is <", finished=True) == "It is <"  # the end: nothing held back
    assert without_thoughts("a<<|channel>x") == "a<" == without_thoughts("a<<|channel>x<channel|>")  # grows only
    assert without_thoughts("Plain") == "Plain"
    units = re.findall(r"<\|channel>|<channel\|>|.", GEMMA_ANSWER + " Or <4>. <", re.DOTALL)
    for seed in range(5):
        rng, pieces, rest = random.Random(seed), [], list(units)
        while rest:
            n = rng.randint(1, 5)
            pieces.append("".join(rest[:n]))
            rest = rest[n:]
        deltas = list(fold(pieces, without_thoughts))
        assert "".join(deltas) == "It is 4. Or <4>. <" and all(deltas)


QWEN3 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{# strips <think> ... </think> #}")
OPENED = QWEN3.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")


def test_think_blocks_are_hidden_whether_the_answer_or_the_prompt_opens_them() -> None:
    """<think> ... </think> (Qwen3, GLM, MiniMax-M2, HunYuan): hidden, and the whitespace after it; a template whose
    generation prompt opens the block (its answer starts inside it) is told apart by rendering a probe."""
    assert OPENED != QWEN3
    found, opened = answer_view(QWEN3), answer_view(OPENED)
    assert found is not None and opened is not None and not found.keep_special
    view, inside = found.shown, opened.shown
    assert view is not inside
    assert view("<think>\nA plan.\n</think>\n\nIt is 4.") == "It is 4."
    assert inside("A plan.\n</think>\n\nIt is 4.") == "It is 4." and inside("A plan") == ""
    assert view("No thought at all.") == "No thought at all."
    answer = "<think>\nhm < 5\n</think>\n\nIt is <4>."
    for seed in range(5):
        rng, pieces, rest = random.Random(seed), [], answer
        while rest:
            n = rng.randint(1, 4)
            pieces.append(rest[:n])
            rest = rest[n:]
        deltas = list(fold(pieces, view))
        assert "".join(deltas) == "It is <4>." and all(deltas)
