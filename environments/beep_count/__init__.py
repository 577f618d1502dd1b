"""beep_count: count the beeps in a synthesized WAV clip (see README.md)."""
