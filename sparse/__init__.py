"""genrec.sparse."""
