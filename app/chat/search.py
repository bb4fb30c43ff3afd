"""Finding a chat from the command palette (Ctrl+P): by its title (fuzzy) or by words anywhere in it."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

from tandem.app.chat.text import fit

if TYPE_CHECKING:
    from tandem.app.chat.store import Conversation
    from tandem.app.chat.tui import TandemApp

CONTENT_SCORE = 0.3  # a chat found by its text ranks below any fuzzy title match worth showing


class ChatSearch(Provider):
    """Each chat is a command that opens it."""

    def chats(self) -> list[Conversation]:
        return cast("TandemApp", self.app).chat.conversations

    def open(self, conv: Conversation) -> None:
        chat = cast("TandemApp", self.app).chat
        chat.open_conversation(conv)
        chat.focus_composer()

    async def discover(self) -> Hits:
        for conv in self.chats()[:10]:
            yield DiscoveryHit(f"chat: {fit(conv.title, 60)}", partial(self.open, conv), help="open this chat")

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for conv in self.chats():
            title = f"chat: {fit(conv.title, 60)}"
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self.open, conv), help="open this chat")
            elif conv.matches(query):
                yield Hit(CONTENT_SCORE, title, partial(self.open, conv), help=f"“{query}” is in this chat")
