"""Experiments: model zoo, stream analysis and the benchmark apps."""
