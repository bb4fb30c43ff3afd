"""The chat app's screens: the chat itself and the dialogs over it (settings, help, rename, model picker, tuning)."""
