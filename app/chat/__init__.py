"""The chat app (Textual): the app (`tui`), its screens and widgets, what it needs from a model (`backend`: the
local runtime or a server elsewhere, `remote`), saved chats (`conversation`, `store`, `search`), settings, the
model's lifecycle, the tuning dialog's choices and heatmap, and `tandem bench chat` (`bench`)."""
