"""Moved (issue 46): DeepSeek's EPLB and the seeds' load-aware mapping compute from loads alone, so
they live in the metrics room, `moescope.metrics.eplb`, beside the placement they return. Their
names are still found here."""

from moescope.metrics.eplb import HOT_SHARE, MID_SHARE, balanced_packing, eplb, load_aware, replicate

__all__ = ["HOT_SHARE", "MID_SHARE", "balanced_packing", "eplb", "load_aware", "replicate"]
