"""Run outputs: metrics rows, summaries, progress lines."""
