"""Small text rules of the chat app: a chat's title from its first message, a title cut to fit, the code blocks of an
answer, sizes in words. Pure functions, tested without a screen."""

from __future__ import annotations

import re

TITLE_CHARS = 40  # a title longer than this is cut (with "…"): the sidebar shows about 22 of them anyway
FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)


def fit(text: str, width: int) -> str:
    """`text` on one line in `width` characters: cut with "…" when it is longer."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: max(0, width - 1)].rstrip() + "…"


def title_from(message: str) -> str:
    """A new chat's title: the first line with words in it, without the Markdown heading marks a user may type."""
    for line in message.splitlines():
        words = re.sub(r"^\s*#+\s*", "", line).strip()
        if words:
            return fit(words, TITLE_CHARS)
    return "New chat"


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of an answer (``` or ~~~), their contents without the fences, in order. An answer
    stopped inside a block has its open block last (the user may want what came so far)."""
    blocks = [m.group(2) for m in FENCE.finditer(markdown)]
    rest = markdown[max((m.end() for m in FENCE.finditer(markdown)), default=0):]
    open_block = re.search(r"^(`{3,}|~{3,})[^\n]*\n(.*)\Z", rest, re.MULTILINE | re.DOTALL)
    if open_block:
        blocks.append(open_block.group(2))
    return [b.rstrip("\n") for b in blocks]


def human_bytes(n: float) -> str:
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.0f} KiB"
