"""Benchmarks of shardtrain.infer (run each as `python -m benchmarks.infer.NAME`)."""
