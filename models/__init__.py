"""genrec.models."""
