"""Load benchmarks for any OpenAI-compatible endpoint: `python -m benchmarks.load --help`."""
