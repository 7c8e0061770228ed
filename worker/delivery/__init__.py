"""Answers to the broker and offsets back: the outbox, acknowledgements, the commit rule and its map."""
