"""tfcluster: run distributed TensorFlow on ordinary machines."""
from __future__ import annotations

__version__ = "0.1.0"
