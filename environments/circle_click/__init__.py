"""circle_click: an image with coloured circles; ``click(x, y)`` inside the named one (see README.md)."""
