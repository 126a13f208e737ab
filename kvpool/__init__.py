"""kvpool: elastic accelerator memory shared between model servers, arbitrated by a daemon."""

__version__ = "0.1.0"
