"""Data for the ranks: shards, minibatch streams, non-IID partitions and the built-in digits dataset."""
