"""genrec.dense."""
