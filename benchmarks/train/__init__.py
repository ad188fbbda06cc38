"""Benchmarks of shardtrain.train (run each as `python -m benchmarks.train.NAME`)."""
