"""Where the repository is, for tests that start its scripts or read its files by path."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
