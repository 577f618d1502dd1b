"""color_pick: one solid colour, a one-word answer; or shown only by a ``look`` tool (see README.md)."""
