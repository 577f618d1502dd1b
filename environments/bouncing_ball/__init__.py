"""bouncing_ball: count a ball's wall bounces in a rendered MP4 (see README.md)."""
