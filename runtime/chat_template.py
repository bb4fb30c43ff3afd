"""Chat templates: untrusted Jinja code from the model folder, rendered sandboxed and bounded.

The sandbox is Jinja's own (no attribute tricks, ranges of at most 100000) plus bounds on everything that can
build something big (operators, filters, str methods) and a watchdog on time and memory, so any template ends
within seconds in the prompt or in `CheckpointError`. Real templates render as plain Jinja renders them.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import re
import string
import threading
import time
import tracemalloc
import types
from datetime import datetime
from typing import Any

from jinja2 import Environment, Template, TemplateError, nodes, pass_environment, pass_eval_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import FilterArgumentError
from jinja2.filters import FILTERS as DEFAULT_FILTERS
from jinja2.filters import make_attrgetter
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.kernels.errors import CheckpointError

# A chat template is code from the model folder: it runs sandboxed and bounded. These bounds sit far above what
# any real template builds (a few KB for a long conversation) and far below what would hang the app or fill memory.
TEMPLATE_MAX_CHARS = 16 << 20  # any text the template builds, and what it renders beyond the messages
TEMPLATE_MAX_ITEMS = 1 << 20  # any list the template builds
TEMPLATE_MAX_BITS = 4096  # any integer the template builds by * or **
TEMPLATE_MAX_SECONDS = 5.0  # compiling and rendering
TEMPLATE_MAX_GROWTH = 1 << 30  # bytes of Python objects a render may leave allocated at any moment
_TEMPLATE_FAILURES = (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
                      RecursionError, MemoryError)

# printf conversions ('%-5s', '%(name)08.3f', '%*d'): their widths and precisions allocate before any check could.
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def _too_big(what: str) -> TemplateError:
    return TemplateError(f"it builds {what} beyond what a prompt can hold")


def _check_chars(size: int) -> None:
    if size > TEMPLATE_MAX_CHARS:
        raise _too_big(f"a text of {size} characters")


def _check_width(width: int) -> None:
    if width > TEMPLATE_MAX_CHARS:
        raise _too_big(f"a text {width} characters wide (a format width or precision)")


def _check_written(value: Any) -> Any:
    """`value`, refused if writing it out (str, repr, JSON) would be too long. One short list can hold the same
    long text or list many times over, and writing it is a single call that no watchdog can interrupt."""
    if isinstance(value, str):
        return value
    size, pending = 0, [value]
    while pending:  # counts every reference, and stops as soon as the count is too big
        item = pending.pop()
        if isinstance(item, str | bytes):
            size += len(item) + 4
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            pending.extend(item)
        size += 2
        if size > TEMPLATE_MAX_CHARS:
            raise TemplateError("it would write out a list or mapping longer than a prompt can hold")
    return value


def _longest_text(values: Any) -> int:
    """How long the longest of `values` is once written (as str or repr), for bounding formatted results."""
    items = values.values() if isinstance(values, dict) else values if isinstance(values, tuple) else (values,)
    for v in items:
        _check_written(v)
    return max((max(len(str(v)), len(repr(v))) for v in items), default=0)


def _printf(text: str, args: Any) -> str:
    """`text % args`, refused when the result would be too big."""
    conversions = [m for m in _PRINTF.finditer(text) if m[3] != "%"]
    numbers = [int(n) for m in conversions for n in (m[1], m[2]) if n and n != "*"]
    if any(m[1] == "*" or m[2] == "*" for m in conversions) and isinstance(args, tuple):
        numbers += [a for a in args if isinstance(a, int)]
    widest = max(numbers, default=0)
    _check_width(widest)
    _check_chars(len(text) + len(conversions) * (widest + _longest_text(args)))
    return text % args


def _check_format(text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a str.format whose result would be too big: huge widths, or one long value written many times."""
    fields = [spec for _, name, spec, _ in string.Formatter().parse(text) if name is not None]
    if any("{" in (spec or "") for spec in fields):
        raise TemplateError("it formats with a width or precision taken from the arguments ('{:{w}}'), which "
                            "chat templates do not need")
    widest = max((int(n) for spec in fields for n in re.findall(r"\d+", spec or "")), default=0)
    _check_width(widest)
    _check_chars(len(text) + len(fields) * (widest + max(_longest_text(args), _longest_text(kwargs))))


def _check_str_method(method: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Refuse the str methods that can build a text much longer than their inputs; the (materialised) arguments."""
    text, name = method.__self__, method.__name__
    width = args[0] if args else kwargs.get("width", kwargs.get("tabsize", 8 if name == "expandtabs" else 0))
    if name in ("ljust", "rjust", "center", "zfill") and isinstance(width, int):
        _check_width(width)
    elif name == "expandtabs" and isinstance(width, int):
        _check_chars(len(text) + text.count("\t" if isinstance(text, str) else b"\t") * width)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str | bytes) and isinstance(args[1], str | bytes):
        times = text.count(args[0]) if args[0] else len(text) + 1
        _check_chars(len(text) + times * max(0, len(args[1]) - len(args[0])))
    elif name == "join" and args:
        items = list(args[0])
        _check_chars(sum(len(i) for i in items if isinstance(i, str | bytes)) + len(text) * max(0, len(items) - 1))
        return (items, *args[1:])
    elif name == "translate":
        table = args[0] if args else None
        longest = max((len(v) for v in table.values() if isinstance(v, str | bytes)), default=1) \
            if isinstance(table, dict) else 1
        _check_chars(len(text) * longest)
    return args


@pass_eval_context
def _join(eval_ctx: EvalContext, value: Any, d: str = "", attribute: str | int | None = None) -> str:
    items = list(value)
    if attribute is not None:
        items = list(map(make_attrgetter(eval_ctx.environment, attribute), items))
    _check_chars(len(str(d)) * max(0, len(items) - 1))  # the separators alone, before writing out every item
    sizes = (len(i) if isinstance(i, str) else len(str(_check_written(i))) for i in items)
    _check_chars(sum(sizes) + len(str(d)) * max(0, len(items) - 1))
    return _PLAIN_FILTERS["join"](eval_ctx, items, d)


@pass_environment
def _sum(environment: Environment, iterable: Any, attribute: str | int | None = None, start: Any = 0) -> Any:
    items = list(iterable)
    if attribute is not None:
        items = list(map(make_attrgetter(environment, attribute), items))
    if isinstance(start, list | tuple) or any(isinstance(i, list | tuple) for i in items):
        # Lists add up one after the other (sum() would copy the growing list each time: quadratic).
        size = sum(len(i) for i in items if isinstance(i, list | tuple)) + len(start)
        if size > TEMPLATE_MAX_ITEMS:
            raise _too_big(f"a list of {size} items")
        total = list(start)
        for item in items:
            total = total + list(item) if isinstance(item, list | tuple) else total + item
        return tuple(total) if isinstance(start, tuple) else total
    return sum(items, start)


def _center(value: Any, width: int = 80) -> str:
    if isinstance(width, int):
        _check_width(width)
    return _PLAIN_FILTERS["center"](value, width)


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    step = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    _check_width(step)
    _check_chars(len(str(s)) + (str(s).count("\n") + 1) * step)
    return _PLAIN_FILTERS["indent"](s, width, first, blank)


@pass_environment
def _wordwrap(environment: Environment, s: Any, width: int = 79, break_long_words: bool = True,
              wrapstring: str | None = None, break_on_hyphens: bool = True) -> str:
    s = str(s)
    if wrapstring is not None:  # at most one line per character of the text, each followed by wrapstring
        _check_chars(len(s) + (len(s) + 1) * len(str(wrapstring)))
    return _PLAIN_FILTERS["wordwrap"](environment, s, width, break_long_words, wrapstring, break_on_hyphens)


@pass_eval_context
def _replace(eval_ctx: EvalContext, s: Any, old: Any, new: Any, count: int | None = None) -> str:
    old_text, new_text, text = str(old), str(new), str(s)
    times = text.count(old_text) if old_text else len(text) + 1
    if count is not None and count >= 0:
        times = min(times, count)
    _check_chars(len(text) + times * max(0, len(new_text) - len(old_text)))
    return _PLAIN_FILTERS["replace"](eval_ctx, s, old, new, count)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    if args and kwargs:
        raise FilterArgumentError("can't handle positional and keyword arguments at the same time")
    return _printf(str(value), kwargs or args)


def _batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
    if fill_with is not None and isinstance(linecount, int) and linecount > TEMPLATE_MAX_ITEMS:
        raise _too_big(f"a list of {linecount} items")
    return _PLAIN_FILTERS["batch"](value, linecount, fill_with)


def _slice(value: Any, slices: int, fill_with: Any = None) -> Any:
    if isinstance(slices, int) and slices > TEMPLATE_MAX_ITEMS:
        raise _too_big(f"{slices} lists")
    return _PLAIN_FILTERS["slice"](value, slices, fill_with)


def _writing(name: str) -> Any:
    """The filter `name`, for one that writes out its whole input (string, tojson, pprint), with the check above."""
    plain = DEFAULT_FILTERS[name]

    @functools.wraps(plain)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_written(args[1] if name == "tojson" else args[0])  # tojson takes the environment first
        return plain(*args, **kwargs)

    return bounded


_PLAIN_FILTERS = dict(DEFAULT_FILTERS)
_BOUNDED_FILTERS = {"join": _join, "sum": _sum, "center": _center, "indent": _indent, "wordwrap": _wordwrap,
                    "replace": _replace, "format": _format, "batch": _batch, "slice": _slice,
                    **{name: _writing(name) for name in ("string", "tojson", "pprint")}}


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, but `a ~ b` goes through the environment's bounded concat."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox (no attribute tricks, ranges of at most 100000) that also refuses, before building them, texts,
    lists and numbers too big for a prompt: by operators (+ * ** % ~), by the filters that can multiply their input
    (join, replace, center, indent, ...) and by the str methods that can (ljust, replace, join, format, ...)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})  # also keeps Jinja from folding them at compile time
    code_generator_class = _BoundedCodeGenerator

    def __init__(self) -> None:
        # As transformers renders chat templates: {% break %} and {% continue %} allowed.
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                         finalize=_check_written)  # {{ value }}
        self.filters.update(_BOUNDED_FILTERS)
        del self.globals["lipsum"]  # lorem ipsum of any length: no chat template needs it
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "+":
            if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                self._check_size(left, len(left) + len(right))
            return operator.add(left, right)
        if operator_name == "%":
            return _printf(left, right) if isinstance(left, str) else operator.mod(left, right)
        if isinstance(left, int) and isinstance(right, int):
            bits = abs(left).bit_length() * abs(right) if operator_name == "**" else \
                left.bit_length() + right.bit_length()
            if bits > TEMPLATE_MAX_BITS:
                what = "raises a number to a power" if operator_name == "**" else "multiplies numbers"
                raise TemplateError(f"the chat template {what} beyond {TEMPLATE_MAX_BITS} bits")
        if operator_name == "**":
            return operator.pow(left, right)
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(times, int) and len(seq) * times > (
                    TEMPLATE_MAX_CHARS if isinstance(seq, str) else TEMPLATE_MAX_ITEMS):
                raise TemplateError("the chat template repeats a text or list beyond what a prompt can hold")
        return operator.mul(left, right)

    @staticmethod
    def _check_size(value: str | list | tuple, size: int) -> None:
        if isinstance(value, str):
            _check_chars(size)
        elif size > TEMPLATE_MAX_ITEMS:
            raise _too_big(f"a list of {size} items")

    def concat(self, values: tuple[Any, ...]) -> str:
        parts = [str(_check_written(v)) for v in values]
        _check_chars(sum(map(len, parts)))
        return "".join(parts)

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        text, is_map = value.__self__, value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if is_map and len(args) == 1 and isinstance(args[0], dict):
                _check_format(text, (), args[0])
            else:
                _check_format(text, args, kwargs)
            return wrapper(*args, **kwargs)

        return bounded

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if isinstance(__obj, types.BuiltinMethodType) and isinstance(getattr(__obj, "__self__", None), str | bytes):
            args = _check_str_method(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


class _Stopped(BaseException):
    """Raised inside the rendering thread by its watchdog. A BaseException, so that no `except Exception` in Jinja
    (constant folding at compile time turns any Exception into "not a constant") can swallow it."""


class _TooSlow(_Stopped):
    pass


class _TooLarge(_Stopped):
    pass


# PyThreadState_SetAsyncExc(thread id, exception class, or NULL to withdraw a pending one), through prototypes of
# our own: setting argtypes on ctypes.pythonapi's shared function would change it for everyone.
_SET_ASYNC_EXC = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi))
_WITHDRAW_ASYNC_EXC = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi))
_WATCH_EVERY = 0.02  # seconds between the watchdog's looks at the clock and at what Python has allocated


class _Watchdog:
    """Stops the template running in this thread once it ran TEMPLATE_MAX_SECONDS, or made Python allocate
    TEMPLATE_MAX_GROWTH bytes more than it freed, by raising _TooSlow or _TooLarge in it.

    Compiled templates are Python bytecode, so the exception lands between two bytecodes: no check inside the
    template is needed, and a loop that yields nothing is stopped too. Each operation the template can run is
    bounded in size (_BoundedEnvironment), so none runs long inside C where the exception cannot land.
    Why a thread and not a subprocess with limits: starting the thread costs tens of microseconds, a subprocess
    milliseconds plus sending the whole conversation, and the chat app renders several times per message.
    The lock and `done` make sure the exception never arrives after the block ended: it is raised only while
    the block runs, and one raised too late to land is withdrawn when the block ends.
    Memory is what tracemalloc counts (Python objects, which are all a template can make), not the process's
    size, which a model loading meanwhile on another thread grows by gigabytes (its tensors are not Python
    objects). Tracing slows Python's allocations while it is on: a chat renders in well under a millisecond."""

    def __init__(self) -> None:
        self.target = threading.get_ident()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.fired = False

    def __enter__(self) -> None:
        self.tracing = not tracemalloc.is_tracing()  # (left on, as found, when someone else traces)
        if self.tracing:
            tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        deadline = time.monotonic() + TEMPLATE_MAX_SECONDS
        threading.Thread(target=self._watch, args=(deadline, start), daemon=True).start()

    def _watch(self, deadline: float, start: int) -> None:
        while not self.done.wait(max(0.0, min(_WATCH_EVERY, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return self._stop(_TooSlow)
            if tracemalloc.get_traced_memory()[0] - start > TEMPLATE_MAX_GROWTH:
                return self._stop(_TooLarge)
        return None

    def _stop(self, exception: type[_Stopped]) -> None:
        with self.lock:
            if not self.done.is_set():
                _SET_ASYNC_EXC(self.target, exception)
                self.fired = True

    def __exit__(self, *exc_info: object) -> None:
        with self.lock:
            self.done.set()
            if self.fired:
                _WITHDRAW_ASYNC_EXC(self.target, None)
        if self.tracing:
            tracemalloc.stop()


def _raise(message: str) -> None:
    raise TemplateError(message)


_ENVIRONMENT = _BoundedEnvironment()


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Template:
    """Compiled once per template text (Jinja's compiling takes far longer than rendering a chat)."""
    return _ENVIRONMENT.from_string(template)


def render(template: str, messages: list[dict[str, str]], add_generation_prompt: bool, bos_token: str,
           eos_token: str) -> str:
    """The prompt `template` renders for these messages; CheckpointError saying why when it fails or runs away."""
    most = TEMPLATE_MAX_CHARS + sum(len(str(m.get("content") or "")) for m in messages)
    try:
        with _Watchdog():
            parts: list[str] = []
            size = 0
            for part in _compiled(template).generate(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
            ):
                parts.append(part)
                size += len(part)
                if size > most:
                    raise TemplateError(f"it rendered more than {TEMPLATE_MAX_CHARS >> 20} M characters beyond "
                                        "the messages")
            return "".join(parts)
    except _TooSlow:
        problem = f"it ran for more than {TEMPLATE_MAX_SECONDS:g} s"
    except _TooLarge:
        problem = f"it took more than {TEMPLATE_MAX_GROWTH >> 20} MB of memory"
    except Exception as e:  # the template is untrusted code: whatever it raises is its failure, not the app's
        problem = str(e) or type(e).__name__
    raise CheckpointError(f"the model's chat template failed: {problem}; fix the template, or run without --chat")
