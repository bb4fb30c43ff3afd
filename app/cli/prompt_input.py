"""The prompt of `tandem generate`: from the command line or from standard input, as UTF-8 text, bounded."""

from __future__ import annotations

import sys

from tandem.kernels.errors import UsageError

BOM = "\ufeff"  # the byte order mark, as text and as UTF-8 bytes
BOM_BYTES = BOM.encode("utf-8")
MAX_PROMPT_BYTES = 4 * 2**20  # 4 MiB: far beyond any context window, and a `/dev/zero` ends here, not in swap


def prompt_text(text: str | None, prompt: str | None) -> str:
    """The prompt, given either way (`-` as the text: read from standard input)."""
    if (text is None) == (prompt is None):
        raise UsageError("give the prompt once: tandem generate \"your prompt\" (or --prompt, or - to read stdin)")
    given = text if text is not None else prompt
    assert given is not None
    if given == "-":
        return read_stdin()
    _check_utf8(given, "the prompt")
    return given


def read_stdin(limit: int = MAX_PROMPT_BYTES) -> str:
    """Standard input as UTF-8 text, read as bytes so that its encoding is checked here rather than guessed
    by the locale; at most `limit` bytes (more is refused: an endless source must not fill the memory)."""
    too_long = UsageError(f"the prompt on standard input is longer than {limit // 2**20} MiB; give a shorter one")
    if sys.stdin is None:  # started with standard input closed (`tandem generate - <&-`)
        raise UsageError("standard input is closed; pipe the prompt in (echo hi | tandem generate -) "
                         "or give it as an argument")
    source = getattr(sys.stdin, "buffer", None)
    if source is None:  # a text stream without bytes beneath (an embedding program's or a test's)
        text = sys.stdin.read(limit + 1)
        if len(text) > limit:
            raise too_long
        _check_utf8(text, "the prompt on standard input")
        return text.removeprefix(BOM)
    data = source.read(limit + 1)
    if len(data) > limit:
        raise too_long
    # a byte order mark (as some Windows editors write) marks the encoding, it is not prompt text
    skip = len(BOM_BYTES) if data.startswith(BOM_BYTES) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = e.start + skip  # the offset in what was given, mark included
        raise UsageError(f"the prompt on standard input is not UTF-8 text (byte 0x{data[at]:02x} at offset "
                         f"{at}); convert it first, e.g. with iconv -t UTF-8") from None


def _check_utf8(text: str, what: str) -> None:
    """Bytes that were not UTF-8 reach Python as lone surrogates (the file system encoding's escape); the
    tokenizer cannot take them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise UsageError(f"{what} is not UTF-8 text ({byte} at character {e.start}); "
                         "convert it first, e.g. with iconv -t UTF-8") from None
