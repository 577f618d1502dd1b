"""counter: text-only, state kept across tool calls through the session (see README.md)."""
