"""side_pick: which side of the image a bar lies along; a one-letter answer (see README.md)."""
