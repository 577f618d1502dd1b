"""grid_door: gymnasium-style key-and-door grid world with an image every step (see README.md)."""
