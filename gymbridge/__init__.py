"""gymbridge."""
