"""Pictures: loss curves, pipeline timelines, memory breakdowns (matplotlib, lazily)."""
