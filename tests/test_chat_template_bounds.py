"""A chat template is untrusted code from the model folder: whatever it does, rendering ends within a few seconds and
without gigabytes of memory, in the prompt or in a CheckpointError. Real templates render exactly as plain Jinja
renders them, and fast."""

from __future__ import annotations

import json
import resource
import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.kernels.errors import CheckpointError
from tandem.runtime import chat_template
from tandem.runtime import tokenizer as tokenizer_module
from tandem.runtime.synth import CHATML
from tandem.runtime.tokenizer import Tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "  Hello!  "}, {"role": "user", "content": "Tell me a joke."}]

BIG = "3000000000"
RUNAWAY = [  # (case, template, a word the error must hold)
    ("a text doubled by +", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}{{ ns.s|length }}", "text"),
    ("a list doubled by +", "{% set ns = namespace(s=[1, 2]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}{{ ns.s|length }}", "list"),
    ("a text doubled by ~", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s|length }}", "text"),
    ("a number squared in a loop", "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
     "{% endfor %}{{ ns.n > 0 }}", "bits"),
    ("center, folded at compile time", "{{ 'a'|center(" + BIG + ") }}", "width"),
    ("a huge printf width", "{{ '%0" + BIG + "d' % 1 }}", "width"),
    ("a huge printf precision", "{{ '%." + BIG + "f' % 1.0 }}", "width"),
    ("a printf width from the arguments", "{{ '%*d' % (" + BIG + ", 1) }}", "width"),
    ("printf of one long text many times", "{{ ('%(a)s' * 100000) % {'a': 'x' * 1000000} }}", "text"),
    ("the format filter", "{{ '%" + BIG + "s'|format('a') }}", "width"),
    ("a huge format width", "{{ '{:>" + BIG + "}'.format(1) }}", "width"),
    ("a format width from the arguments", "{{ '{:>{w}}'.format(1, w=" + BIG + ") }}", "format"),
    ("format_map of one long text many times", "{{ ('{a}' * 100000).format_map({'a': 'x' * 1000000}) }}", "text"),
    ("ljust", "{{ 'a'.ljust(" + BIG + ") }}", "width"),
    ("rjust", "{{ 'a'.rjust(" + BIG + ") }}", "width"),
    ("center", "{{ 'a'.center(" + BIG + ") }}", "width"),
    ("zfill", "{{ '1'.zfill(" + BIG + ") }}", "width"),
    ("expandtabs", "{{ '\\t'.expandtabs(" + BIG + ") }}", "text"),
    ("str.replace", "{{ ('a' * 1000000).replace('a', 'b' * 1000) }}", "text"),
    ("the replace filter", "{{ ('a' * 1000000)|replace('a', 'b' * 1000) }}", "text"),
    ("the indent filter", "{{ 'a\\nb'|indent(" + BIG + ") }}", "text"),
    ("indent of many lines", "{{ ('\\n' * 1000000)|indent('x' * 1000, blank=true) }}", "text"),
    ("the wordwrap filter", "{{ ('a ' * 1000000)|wordwrap(1, wrapstring='x' * 1000) }}", "text"),
    ("the truncate filter", "{{ 'a b'|truncate(" + BIG + ") }}", None),  # harmless: just renders
    ("batch with a filler", "{{ [1]|batch(" + BIG + ", 'x')|list|length }}", "list"),
    ("slice into many lists", "{{ [1]|slice(30000000)|list|length }}", "list"),
    ("lipsum", "{{ lipsum(n=100000000) }}", "lipsum"),
    ("nested loops printing nothing", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
     "{% endfor %}x", "ran for more than"),
    ("join of a long list of long texts", "{{ (['x' * 1000000] * 1000)|join }}", "text"),
    ("str.join of a long list of long texts", "{{ ''.join(['x' * 1000000] * 1000) }}", "text"),
    ("a long separator", "{{ range(100000)|join('x' * 1000) }}", "text"),
    ("one long text written many times", "{{ ['x' * 10000000] * 1000 }}", "write out"),
    ("... as JSON", "{{ (['x' * 10000000] * 1000)|tojson }}", "write out"),
    ("... after ~", "{{ 'a' ~ (['x' * 10000000] * 1000) }}", "write out"),
    ("... nested", "{% set a = ['x' * 1000] * 1000 %}{{ ([a] * 1000)|string }}", "write out"),
    ("sum of lists", "{{ ([[1] * 1000000] * 1000)|sum(start=[])|length }}", "list"),
    ("a long list of lists, each long", "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
     "{% set ns.l = ns.l + [('x' * 10000000) ~ i] %}{% endfor %}{{ ns.l|length }}", None),
]


def bounded_render(template: str) -> str:
    tok = Tokenizer(tokenizer_module.HFTokenizer.from_str(json.dumps(_TINY_TOKENIZER)), {}, template)
    return tok.render_chat(CHAT)


_TINY_TOKENIZER = {"version": "1.0", "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}}


@pytest.mark.parametrize("case, template, needle", RUNAWAY, ids=[r[0] for r in RUNAWAY])
def test_runaway_templates_end_soon_and_small(monkeypatch: pytest.MonkeyPatch, case: str, template: str,
                                              needle: str | None) -> None:
    """Each runaway stops at the bound it is meant to meet, on any CPU at any load: the time limit only for the one
    that makes nothing (1 s), and a limit no machine reaches first for the others, whose size checks must stop them
    (they take 0.01-0.7 s here; the bound on the whole allows a CPU 25 times slower)."""
    timed = needle == "ran for more than"
    monkeypatch.setattr(chat_template, "TEMPLATE_MAX_SECONDS", 1.0 if timed else 600.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.monotonic()
    try:
        bounded_render(template)
    except CheckpointError as e:
        assert str(e).startswith("the model's chat template failed: "), e
        assert needle is None or needle in str(e), e
    else:
        assert needle is None, "rendered"
    assert time.monotonic() - start < 20.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 1_500_000  # KiB


REAL_TEMPLATES = {
    "chatml": CHATML,
    "smollm (the built-in model)": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "mixtral": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"),
    "llama-2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
        "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"),
    "qwen-style with tools": (
        "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
        "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
        "{%- if ns.multi_step_tool and message.role == 'user' %}"
        "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content|trim }}"
        "{%- if loop.index0 > ns.last_query_index %}{{- ' (after the last query)' }}{%- endif %}"
        "{{- '<|im_end|>\\n' }}{%- if loop.last and add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}{%- endfor %}{{ {'tools': [], 'n': messages|length}|tojson }}"),
    "dates, formats and joins": (
        "{{ strftime_now('%Y') | length }} {{ '%-5s|%5.1f' % ('ab', 2.25) }} {{ '{:>6}|{:.2f}'.format('x', 1.5) }} "
        "{{ messages|map(attribute='role')|join(', ') }} {{ 'a\\nb'|indent(2) }} {{ 'abc'|center(9) }} "
        "{{ [[1], [2]]|sum(start=[]) }} {{ 'a-b'.replace('-', '+') }} {{ '1'.zfill(3) }} {{ 20240101 % 7 }} "
        "{{ 'x' * 3 }} {{ 2 ** 10 }} {{ [1, 2] + [3] }} {{ 'a' ~ 1 ~ none }} {{ 'one two'|wordwrap(3) }}"),
}


@pytest.mark.parametrize("name", list(REAL_TEMPLATES))
def test_real_templates_render_as_plain_jinja_does(name: str) -> None:
    template = REAL_TEMPLATES[name].replace("strftime_now('%Y') | length", "4")
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=["jinja2.ext.loopcontrols"])
    plain.globals["raise_exception"] = chat_template._raise
    chat = CHAT[1:] if name in ("mixtral",) else CHAT
    expected = plain.from_string(template).render(messages=chat, add_generation_prompt=True, bos_token="<s>",
                                                  eos_token="</s>")
    tok = Tokenizer(tokenizer_module.HFTokenizer.from_str(json.dumps(_TINY_TOKENIZER)),
                    {"bos_token": "<s>", "eos_token": "</s>"}, REAL_TEMPLATES[name])
    assert tok.render_chat(chat) == expected


def test_raise_exception_still_explains() -> None:
    with pytest.raises(CheckpointError, match="Only user and assistant roles"):
        bounded_render("{% if messages[0].role == 'system' %}"
                       "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}")


def test_a_normal_template_stays_fast() -> None:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(20)]
    tok = Tokenizer(tokenizer_module.HFTokenizer.from_str(json.dumps(_TINY_TOKENIZER)), {},
                    REAL_TEMPLATES["smollm (the built-in model)"])
    tok.render_chat(turns)
    start = time.perf_counter()
    for _ in range(50):
        tok.render_chat(turns)
    assert (time.perf_counter() - start) / 50 < 0.02  # far above a normal render: a busy machine passes, runaways fail


def test_the_time_limit_never_strikes_after_a_render_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    # A limit as short as a render: each render either returns or says it ran too long; nothing arrives later.
    monkeypatch.setattr(chat_template, "TEMPLATE_MAX_SECONDS", 0.0005)
    outcomes = set()
    for _ in range(300):
        try:
            bounded_render(CHATML)
            outcomes.add("rendered")
        except CheckpointError as e:
            assert "ran for more than" in str(e), e
            outcomes.add("stopped")
        sum(range(2000))  # bytecode where a late stop would land
    time.sleep(0.01)
    sum(range(20000))
    assert outcomes
