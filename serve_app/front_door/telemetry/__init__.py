"""What each request did, recorded once and read three ways: metrics, the log line, the span.

Runs in each model replica.
"""
