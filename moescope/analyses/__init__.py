"""Reports that combine store queries with metrics: the expert-cache what-if, jitter, training."""
