"""Building blocks that several algorithms are made of (not algorithms themselves, so nothing here
registers a name)."""
