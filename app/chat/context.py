"""Fitting a long conversation into the model's context: the oldest turns are left out of the prompt.

The system prompt and the newest question always stay, and the prompt keeps room for the answer. Once turns have to
go, the prompt's beginning should change as seldom as possible: the KV cache holds the last prompt, and a prompt that
begins as it prefills only its new tokens (prefix reuse), while one that begins elsewhere prefills all of them. So a
conversation that had to drop turns keeps starting where it did while it fits from there, and when more must go, the
oldest go until it takes at most half the room, leaving the next turns room to grow on the same beginning (llama.cpp
discards half its context when it is full, for the same reason). Pure functions of the messages and a token counter,
so the rule is tested without a model.
"""

from __future__ import annotations

from collections.abc import Callable

Messages = list[dict[str, str]]


def answer_room(context: int, max_new_tokens: int) -> int:
    """Tokens kept free for the answer: all it may use, but at most a quarter of the context (a long
    conversation still gets most of it), and at least one (the engine needs a prompt shorter than the context)."""
    return max(1, min(max_new_tokens, context // 4))


def fit_messages(messages: Messages, count: Callable[[Messages], int], limit: int, since: int = 0
                 ) -> tuple[Messages, int]:
    """The newest messages whose prompt takes at most `limit` tokens, and how many older ones were left out.

    Leading system messages are always kept. What is kept starts at a question (chat templates want a user
    message first), and the newest question is kept even when it alone is over the limit: the engine then
    says how long the prompt is. `since`: how many the previous prompt of this conversation left out; while the
    conversation from there fits, the prompt starts there again, and when more must go, they go until it takes at
    most half of `limit` (module docstring), unless only the newest question would be left: then as many as fit.
    `count` is only called O(log n) times (the prompt shrinks as turns go)."""
    if count(messages) <= limit:
        return messages, 0
    n_head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    head, body = messages[:n_head], messages[n_head:]
    starts = [i for i, m in enumerate(body) if m["role"] == "user" and i > 0]
    if not starts:
        return messages, 0
    if since in starts and count(head + body[since:]) <= limit:
        return head + body[since:], since
    def first_within(most: int) -> int:
        """The first start from which the prompt takes at most `most` tokens; the last (the newest question)
        when none does."""
        lo, hi = 0, len(starts) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if count(head + body[starts[mid]:]) <= most:
                hi = mid
            else:
                lo = mid + 1
        return starts[lo]

    # half the room where that keeps more than the question alone (the answer it replies to, above all)
    start = first_within(limit // 2)
    if start == starts[-1]:
        start = first_within(limit)
    return head + body[start:], start
