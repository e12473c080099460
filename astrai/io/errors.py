"""Errors for bad model folders: each message names the file, field or tensor at fault."""


class CheckpointError(ValueError):
    """A model folder is missing, incomplete or corrupt; the message names the file and tensor."""


class UnsupportedModelError(CheckpointError):
    """A checkpoint uses a model family or option astrai does not implement."""
