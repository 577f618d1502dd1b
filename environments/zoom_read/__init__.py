"""zoom_read: a large canvas, small digits; ``zoom(bbox)`` crops, ``answer(value)`` ends (see README.md)."""
