"""What a run tells: metric events, loggers and trackers, and the end-of-run summary."""
