"""genrec.data."""
