"""The error of a checkpoint on disk, whichever format holds it."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that does not hold what its config describes (a missing, unexpected or
    misshapen tensor), or a converted one that is incomplete or of another format version."""
